"""Hugging Face ``config.json`` of a hybrid Mamba2/attention family -> ``HybridConfig``.

Families (``model_type``): ``bamba`` (``BambaForCausalLM``), ``granitemoehybrid``
(``GraniteMoeHybridForCausalLM``, dense only: Granite-4.0-H) and ``nemotron_h``
(``NemotronHForCausalLM``). Both spellings in the wild are read:

- layer pattern: ``layers_block_type`` / ``layer_types`` lists (transformers 5: ``linear_attention``,
  ``full_attention``, ``mlp``, ``moe``; 4.x: ``mamba``, ``attention``), Nemotron-H's
  ``hybrid_override_pattern`` string (``M`` Mamba, ``*`` attention, ``-`` MLP, ``E`` MoE), Bamba's
  ``attn_layer_indices`` with ``num_hidden_layers``;
- rotary: ``rope_parameters`` (5.x: ``rope_theta``, ``rope_type``, ``partial_rotary_factor``) or
  top-level ``rope_theta`` / ``partial_rotary_factor`` (4.x);
- non-finite floats: 5.x's ``{"__float__": "Infinity"}`` and 4.x's bare ``Infinity``;
- Nemotron-H's Mamba fields under their config names (``mamba_num_heads``, ``n_groups``,
  ``conv_kernel``, ...) or the constructor aliases (``mamba_n_groups``, ``mamba_d_conv``, ...).

What each family maps to (the math is transformers 5's):

- Bamba: mixer + SwiGLU MLP per layer, grouped-query attention with rotary on the first
  ``partial_rotary_factor`` (default 0.5) of each head, gated norm over the whole mixer width.
- Granite-4.0-H: mixer + SwiGLU MLP (``shared_mlp.input_linear`` is ``[gate; up]``), rotary only when
  ``position_embedding_type == "rope"``, softmax scale ``attention_multiplier``, embeddings times
  ``embedding_multiplier``, every block's output times ``residual_multiplier``, logits divided by
  ``logits_scaling``; gated norm over the whole width.
- Nemotron-H: one operation per layer behind one norm, squared-ReLU MLP without a gate, no position
  embedding, explicit ``head_dim``, gated norm per group of ``d_inner / n_groups``.

``dt`` (one semantics for every forward): ``softplus(dt + dt_bias)`` clamped to ``time_step_limit``
(Bamba, Granite; ``(0, inf)`` by default: no clamp) or to ``[time_step_min, inf)`` (Nemotron-H).
transformers 5 clamps in its multi-token (prefill) path and not in single-token decode; batchc clamps
in decode and verify too, so its decode equals transformers' full-sequence forward at every position.

Attention heads are ``head_dim`` wide when the config sets it (every family, as transformers reads
it: q/k/v then project ``hidden_size`` to ``heads * head_dim``, which need not equal ``hidden_size``),
else ``hidden_size / num_attention_heads`` (Bamba, Granite; Nemotron-H: 128).

Refused, with one line naming the config.json key as written and its value (never a
``HybridConfig`` field: every bound it checks is checked here first, in the config's words): an
unknown ``model_type``, MoE (``num_local_experts > 0``, ``moe`` / ``E`` layers), biases the
architecture has none of (``attention_bias``, ``mlp_bias``, ``mamba_proj_bias`` / ``use_bias``),
``rope_scaling`` or a ``rope_type`` other than ``default``, activations other than SiLU (and squared
ReLU for Nemotron-H's MLP), sizes that do not fit.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from backend.hybrid.checkpoint import CheckpointError, config_number
from backend.hybrid.config import MAX_DIM, MAX_LAYERS, MAX_VOCAB, HybridConfig, LayerKind
from ir.errors import short_repr

__all__ = ["FAMILIES", "MAX_EOS_IDS", "MAX_JSON_BYTES", "MAX_POSITIONS_DEFAULT", "HFConfig", "parse_config", "read_json"]

FAMILIES = {"bamba": "Bamba", "granitemoehybrid": "Granite-4.0-H", "nemotron_h": "Nemotron-H"}
"""``model_type`` -> family name, for every supported family."""

MAX_EOS_IDS = 64
"""Most end-of-sequence ids (``Engine.admit`` takes at most 64 stop ids per request)."""

_KIND_NAMES: dict[str, LayerKind | None] = {
    "mamba": "mamba", "linear_attention": "mamba", "M": "mamba",
    "attention": "attn", "full_attention": "attn", "*": "attn",
    "mlp": "mlp", "-": "mlp",
    "moe": None, "E": None,
}
"""A layer name or pattern letter -> layer kind (``None``: MoE, refused)."""


@attrs.frozen(kw_only=True)
class HFConfig:
    """A parsed ``config.json``: the model's ``HybridConfig`` and what serving needs besides."""

    family: str
    """``model_type``: one of ``FAMILIES``."""
    config: HybridConfig
    eos_ids: tuple[int, ...]
    bos_id: int | None
    pad_id: int | None
    conv_bias: bool
    """Whether the checkpoint holds Mamba conv biases (without them the loader uses zeros)."""
    max_positions: int
    """``max_position_embeddings``: the context the model was made for (transformers' default of the
    family when the config leaves it out); the default context length of a run."""


MAX_POSITIONS_DEFAULT = {"bamba": 262144, "granitemoehybrid": 2048, "nemotron_h": 4096}
"""transformers 5's ``max_position_embeddings`` default per family, for a config that leaves it out."""


def _walk_floats(value: object) -> object:
    """5.x's ``{"__float__": "Infinity"}`` (and ``-Infinity``, ``NaN``) as Python floats."""
    if isinstance(value, dict):
        if set(value) == {"__float__"} and value["__float__"] in ("Infinity", "-Infinity", "NaN"):
            return float(value["__float__"].replace("Infinity", "inf"))
        return {k: _walk_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_walk_floats(v) for v in value]
    return value


MAX_JSON_BYTES = 16 << 20
"""Largest ``config.json``, shard index or ``generation_config.json`` read (real ones are kilobytes;
a shard index of a thousand-layer model is well under a megabyte)."""


def read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from ``path`` (bare ``Infinity``/``NaN`` allowed, as 4.x wrote them), or
    ``CheckpointError`` naming the file; at most ``MAX_JSON_BYTES``."""
    try:
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise CheckpointError(path, f"{what} of {size} bytes is over the limit of {MAX_JSON_BYTES} (16 MiB)")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointError(path, f"no {what} (the directory needs one)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(path, f"cannot read {what} ({e})") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(path, f"{what} is not JSON ({e})") from None
    except RecursionError:
        raise CheckpointError(path, f"{what} is nested too deeply") from None
    except ValueError:  # int(): a literal longer than the interpreter's digit limit
        raise CheckpointError(path, f"{what} is not JSON we read (an integer of more than {sys.get_int_max_str_digits()} digits)") from None
    if not isinstance(raw, dict):
        raise CheckpointError(path, f"{what} must hold a JSON object, got {type(raw).__name__}")
    try:
        walked = _walk_floats(raw)
    except RecursionError:
        raise CheckpointError(path, f"{what} is nested too deeply") from None
    assert isinstance(walked, dict)
    return walked


class _Fields:
    """Typed reads of one config dict; every refusal names the field."""

    def __init__(self, path: Path, raw: Mapping[str, Any]) -> None:
        self.path, self.raw = path, raw

    def fail(self, name: str, detail: str) -> CheckpointError:
        return CheckpointError(self.path, f"field {name!r}: {detail}")

    def has(self, name: str) -> bool:
        return name in self.raw and self.raw[name] is not None

    def first(self, names: Sequence[str]) -> str | None:
        """The first of ``names`` the config sets (not null)."""
        return next((n for n in names if self.has(n)), None)

    def key(self, *names: str) -> str:
        """The key the config spells the field with (the first of ``names`` set; else the first
        name, which is what transformers writes)."""
        return self.first(names) or names[0]

    def int_(self, *names: str, default: int | None = None, low: int = 1, high: int | None = None) -> int:
        """An integer field (the first of ``names`` set) in ``[low, high]`` (sizes: at least 1)."""
        name = self.first(names)
        if name is None:
            if default is None:
                raise CheckpointError(self.path, f"missing field {names[0]!r}")
            return default
        value = self.raw[name]
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(name, f"must be an integer, got {short_repr(value)}")
        if value < low:
            raise self.fail(name, f"must be at least {low}, got {_shown_number(value)}")
        if high is not None and value > high:
            raise self.fail(name, f"must be at most {high}, got {_shown_number(value)}")
        return value

    def size(self, *names: str, default: int | None = None) -> int:
        """A size field: an integer in ``[1, MAX_DIM]`` (``HybridConfig``'s bound)."""
        return self.int_(*names, default=default, high=MAX_DIM)

    def positive(self, *names: str, default: float, at_most: float = math.inf) -> float:
        """A finite number field in ``(0, at_most]``."""
        value = self.float_(*names, default=default)
        if not 0 < value <= at_most:
            bound = "a finite positive number" if at_most == math.inf else f"in (0, {at_most:g}]"
            raise self.fail(self.key(*names), f"must be {bound}, got {value:g}")
        return value

    def float_(self, *names: str, default: float) -> float:
        """A finite number field (the first of ``names`` set)."""
        name = self.first(names)
        if name is None:
            return default
        number = config_number(self.raw[name])
        if number is None or not math.isfinite(number):
            raise self.fail(name, f"must be a finite number, got {_shown_number(self.raw[name])}")
        return number

    def bool_(self, *names: str, default: bool) -> bool:
        name = self.first(names)
        if name is None:
            return default
        value = self.raw[name]
        if not isinstance(value, bool):
            raise self.fail(name, f"must be true or false, got {short_repr(value)}")
        return value

    def str_(self, *names: str, default: str | None) -> str | None:
        name = self.first(names)
        if name is None:
            return default
        value = self.raw[name]
        if not isinstance(value, str):
            raise self.fail(name, f"must be a string, got {short_repr(value)}")
        return value

    def refuse_true(self, *names: str, why: str) -> None:
        for name in names:
            if self.has(name) and self.raw[name] is not False:
                raise self.fail(name, f"{short_repr(self.raw[name])} is not supported: {why}")

    def ids(self, name: str) -> tuple[int, ...]:
        """An id or a list of ids (``eos_token_id``); empty when unset."""
        if not self.has(name):
            return ()
        value = self.raw[name]
        values = value if isinstance(value, list) else [value]
        if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
            raise self.fail(name, f"must be a token id >= 0 or a non-empty list of them, got {short_repr(value)}")
        if len(values) > MAX_EOS_IDS:
            raise self.fail(name, f"at most {MAX_EOS_IDS} ids, got {len(values)}")
        return tuple(dict.fromkeys(values))


def _shown_number(value: object) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**18:
        return f"an integer of {len(str(abs(value)))} digits"
    return short_repr(value)


def _layers(f: _Fields) -> tuple[LayerKind, ...]:
    """The layer pattern from whichever spelling the config uses."""
    names: list[str]
    source = f.first(("layers_block_type", "layer_types", "hybrid_override_pattern"))
    if source is not None and source != "hybrid_override_pattern":
        value = f.raw[source]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise f.fail(source, f"must be a list of layer names, got {short_repr(value)}")
        names = value
    elif source is not None:
        value = f.raw[source]
        if not isinstance(value, str):
            raise f.fail(source, f"must be a string of layer letters, got {short_repr(value)}")
        names = list(value[: MAX_LAYERS + 1])
    else:  # Bamba: attention layers by index, Mamba elsewhere
        source = "attn_layer_indices"
        n = f.int_("num_hidden_layers")
        if n > MAX_LAYERS:
            raise f.fail("num_hidden_layers", f"at most {MAX_LAYERS} layers, got {_shown_number(n)}")
        indices = f.raw.get(source)
        indices = [] if indices is None else indices
        if not isinstance(indices, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in indices):
            raise f.fail(source, f"must be a list of layer indices in [0, {n}), got {short_repr(indices)}")
        attention = set(indices)
        names = ["attention" if i in attention else "mamba" for i in range(n)]
    if len(names) > MAX_LAYERS:
        raise f.fail(source, f"at most {MAX_LAYERS} layers, got {len(value) if source != 'attn_layer_indices' else len(names)}")
    kinds: list[LayerKind] = []
    for i, name in enumerate(names):
        if name not in _KIND_NAMES:
            raise f.fail(source, f"layer {i}: unknown layer {name!r} (known: {sorted(_KIND_NAMES)})")
        kind = _KIND_NAMES[name]
        if kind is None:
            raise f.fail(source, f"layer {i} is a mixture-of-experts layer ({name!r}): MoE variants are not supported")
        kinds.append(kind)
    if f.has("num_hidden_layers") and source != "attn_layer_indices" and f.int_("num_hidden_layers") != len(kinds):
        raise f.fail("num_hidden_layers", f"{f.raw['num_hidden_layers']} but {source!r} lists {len(kinds)} layers")
    if "mamba" not in kinds:
        raise f.fail(source, f"no Mamba layer among its {len(kinds)} layers: batchc serves hybrids with at least one")
    return tuple(kinds)


def _rope(f: _Fields, *, default_partial: float) -> tuple[float, float]:
    """``(rope_theta, partial_rotary_factor)``; ``rope_scaling`` and non-default rope types refused."""
    if f.has("rope_scaling"):
        raise f.fail("rope_scaling", f"{short_repr(f.raw['rope_scaling'])} is not supported (plain rotary only)")
    params = f.raw.get("rope_parameters")
    theta_default = f.float_("rope_theta", default=10000.0)
    partial_default = f.float_("partial_rotary_factor", default=default_partial)
    if params is None:
        if theta_default < 1:
            raise f.fail("rope_theta", f"must be at least 1, got {theta_default:g}")
        return theta_default, partial_default
    if not isinstance(params, dict):
        raise f.fail("rope_parameters", f"must be an object, got {short_repr(params)}")
    sub = _Fields(f.path, params)
    kind = sub.str_("rope_type", "type", default="default")
    if kind != "default":
        raise f.fail("rope_parameters", f"rope_type {kind!r} is not supported (plain rotary only)")
    theta = sub.float_("rope_theta", default=theta_default)
    if theta < 1:  # below 1 the rotary frequencies exceed a radian per position and overflow float32
        raise f.fail("rope_parameters.rope_theta" if sub.has("rope_theta") else "rope_theta", f"must be at least 1, got {theta:g}")
    return theta, sub.float_("partial_rotary_factor", default=partial_default)


def _act(f: _Fields, name: str, want: str, default: str) -> None:
    value = f.str_(name, default=default)
    if value != want:
        raise f.fail(name, f"{value!r} is not supported (this family's {want!r} only)")


def parse_config(path: Path, raw: Mapping[str, Any]) -> HFConfig:
    """``raw`` (a ``config.json`` read by ``read_json``) as an ``HFConfig``; ``CheckpointError``
    naming the field for anything batchc cannot serve exactly."""
    f = _Fields(path, raw)
    family = f.str_("model_type", default=None)
    if family not in FAMILIES:
        raise f.fail("model_type", f"{short_repr(family)} is not supported (supported: {sorted(FAMILIES)})")
    # Every bound HybridConfig checks is checked here first, in the config's own keys and values:
    # a refusal names what the user wrote (hidden_size, num_key_value_heads), never batchc's fields.
    d_model = f.size("hidden_size")
    heads = f.size("num_attention_heads")
    kv_heads = f.size("num_key_value_heads", default=heads)
    if heads % kv_heads:
        raise f.fail("num_key_value_heads", f"{kv_heads} does not divide num_attention_heads {heads} "
                                            "(each KV head serves a whole group of query heads)")
    layers = _layers(f)
    f.refuse_true("attention_bias", "mlp_bias", why="the architecture has no such biases")
    switches: dict[str, Any] = {}
    if family == "nemotron_h":
        f.refuse_true("use_bias", why="Mamba projections without biases only")
        _act(f, "mlp_hidden_act", "relu2", "relu2")
        _act(f, "mamba_hidden_act", "silu", "silu")
        nheads = f.size("mamba_num_heads")
        head_dim = f.size("mamba_head_dim")
        groups_key = f.key("n_groups", "mamba_n_groups")
        ngroups = f.size("n_groups", "mamba_n_groups", default=8)
        mamba: dict[str, int] = dict(
            nheads=nheads, head_dim=head_dim, d_state=f.size("ssm_state_size", "mamba_d_state"), ngroups=ngroups,
            conv_width=f.int_("conv_kernel", "mamba_d_conv", default=4, low=2, high=4),
        )
        heads_key = "mamba_num_heads"
        conv_bias = f.bool_("use_conv_bias", "mamba_conv_bias", default=True)
        # transformers' NemotronHAttention: head_dim as given (default 128), whatever hidden_size is
        attn_head_dim = f.size("head_dim", "attention_head_dim", default=128)
        mlp_hidden = f.size("intermediate_size")
        eps = f.positive("layer_norm_epsilon", default=1e-5, at_most=1.0)
        tie = False  # transformers 5 never ties Nemotron-H's output projection
        dt_min = f.float_("time_step_min", "mamba_dt_min", default=0.001)
        if dt_min < 0:
            raise f.fail(f.key("time_step_min", "mamba_dt_min"), f"must be at least 0, got {dt_min:g}")
        switches.update(block="single", mlp_kind="relu2", rotary_dim=0, norm_groups=ngroups, dt_min=dt_min)
        theta = 10000.0
    else:
        f.refuse_true("mamba_proj_bias", why="Mamba projections without biases only")
        _act(f, "hidden_act", "silu", "silu")
        if "mlp" in layers:
            raise f.fail("layer_types", f"{FAMILIES[family]} has no MLP-only layers")
        nheads = f.size("mamba_n_heads", default=128)
        expand = f.size("mamba_expand", default=2)
        width = expand * d_model  # transformers' mamba intermediate size
        head = raw.get("mamba_d_head", "auto")
        if head == "auto" or head is None:
            if width % nheads:
                raise f.fail("mamba_n_heads", f"{nheads} does not divide mamba_expand * hidden_size = {width}")
            head_dim = width // nheads
            if head_dim > MAX_DIM:
                raise f.fail("mamba_expand", f"mamba_expand * hidden_size / mamba_n_heads = {head_dim} is over {MAX_DIM}")
        else:
            head_dim = f.size("mamba_d_head")
            if head_dim * nheads != width:  # transformers' config refuses the same
                raise f.fail("mamba_d_head", f"{head_dim} * mamba_n_heads {nheads} = {head_dim * nheads} is not "
                                             f"mamba_expand * hidden_size = {width}")
        groups_key, heads_key = "mamba_n_groups", "mamba_n_heads"
        mamba = dict(
            nheads=nheads, head_dim=head_dim, d_state=f.size("mamba_d_state", default=256),
            ngroups=f.size("mamba_n_groups", default=1), conv_width=f.int_("mamba_d_conv", default=4, low=2, high=4),
        )
        conv_bias = f.bool_("mamba_conv_bias", default=True)
        # transformers' attention: head_dim when the config sets one (q/k/v/o then project between
        # hidden_size and heads * head_dim), else hidden_size // num_attention_heads
        if f.has("head_dim"):
            attn_head_dim = f.size("head_dim")
        elif d_model % heads:
            raise f.fail("num_attention_heads", f"{heads} does not divide hidden_size {d_model} (and no head_dim is set)")
        else:
            attn_head_dim = d_model // heads
        eps = f.positive("rms_norm_eps", default=1e-5 if family == "bamba" else 1e-6, at_most=1.0)
        tie = f.bool_("tie_word_embeddings", default=False)
        limit = raw.get("time_step_limit", [0.0, math.inf])
        bounds = [config_number(v) for v in limit] if isinstance(limit, list) and len(limit) == 2 else [None]
        if any(b is None or math.isnan(b) for b in bounds):
            raise f.fail("time_step_limit", f"must be a pair of numbers, got {short_repr(limit)}")
        lo, hi = bounds
        assert lo is not None and hi is not None
        if not math.isfinite(lo) or lo < 0 or not lo < hi:
            raise f.fail("time_step_limit", f"must be [low, high] with 0 <= low < high (high may be infinite), got {short_repr(limit)}")
        switches.update(norm_groups=1, dt_min=lo, dt_max=hi)
        if family == "bamba":
            mlp_hidden = f.size("intermediate_size")
            theta, partial = _rope(f, default_partial=0.5)
            if not 0 <= partial <= 1:
                raise f.fail("partial_rotary_factor", f"must be in [0, 1], got {partial}")
            rotary = int(attn_head_dim * partial)  # transformers' rotary width, rounded down as it does
            if rotary % 2:
                raise f.fail("partial_rotary_factor", f"{partial} of a head of {attn_head_dim} rotates {rotary} dims: "
                                                      "rotary embeddings rotate pairs, an even number")
            switches.update(rotary_dim=rotary)
        else:
            if f.int_("num_local_experts", default=8, low=0):
                raise f.fail("num_local_experts", f"{raw.get('num_local_experts', 8)}: MoE variants are not supported (dense Granite-4.0-H only)")
            mlp_hidden = f.size("shared_intermediate_size", default=1024)
            position = f.str_("position_embedding_type", default=None)
            if position not in (None, "nope", "rope"):
                raise f.fail("position_embedding_type", f"{position!r} is not supported (rope, nope or null)")
            theta, partial = _rope(f, default_partial=1.0)
            if position == "rope" and partial != 1.0:
                raise f.fail("partial_rotary_factor", f"{partial}: Granite-4.0-H rotates whole heads")
            if position == "rope" and attn_head_dim % 2:
                shown = "head_dim" if f.has("head_dim") else "hidden_size / num_attention_heads"
                raise f.fail(f.key("head_dim"), f"{shown} = {attn_head_dim}: rotary embeddings (position_embedding_type "
                                                "'rope') rotate pairs, an even number of dims")
            logits_scaling = f.positive("logits_scaling", default=1.0)
            switches.update(
                rotary_dim=None if position == "rope" else 0,
                attn_scale=f.positive("attention_multiplier", default=1.0),
                embed_scale=f.positive("embedding_multiplier", default=1.0),
                residual_scale=f.positive("residual_multiplier", default=1.0),
                logit_scale=1.0 / logits_scaling,
            )
    if mamba["nheads"] % mamba["ngroups"]:
        raise f.fail(groups_key, f"{mamba['ngroups']} does not divide {heads_key} {mamba['nheads']} (Mamba heads share B and C by group)")
    if switches.get("rotary_dim") == attn_head_dim:
        switches["rotary_dim"] = None
    kv = None if kv_heads == heads else kv_heads
    try:
        config = HybridConfig(
            d_model=d_model, layers=layers, attn_heads=heads, attn_head_dim=attn_head_dim, rope_theta=theta,
            mlp_hidden=mlp_hidden, rms_eps=eps, vocab=f.int_("vocab_size", high=MAX_VOCAB), attn_kv_heads=kv,
            tie_embeddings=tie, nheads=mamba["nheads"], head_dim=mamba["head_dim"], d_state=mamba["d_state"],
            ngroups=mamba["ngroups"], conv_width=mamba["conv_width"], **switches,
        )
    except ValueError as e:  # pragma: no cover - every bound is checked above in the config's keys
        raise CheckpointError(path, f"unsupported config ({FAMILIES[family]}): {e}") from None
    return HFConfig(
        family=family, config=config, eos_ids=f.ids("eos_token_id"), bos_id=next(iter(f.ids("bos_token_id")), None),
        pad_id=next(iter(f.ids("pad_token_id")), None), conv_bias=conv_bias,
        max_positions=f.int_("max_position_embeddings", default=MAX_POSITIONS_DEFAULT[family]),
    )
