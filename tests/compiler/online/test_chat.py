"""``/v1/chat/completions`` end to end on a Hugging Face checkpoint directory (a tiny random one,
``backend.tools.hf_random``) with a ``chat_template`` in its tokenizer_config.json, served by
``batchc serve --model DIR`` and asked through the real ``openai`` client: the prompt the engine
gets is the template's rendering as transformers renders and tokenises it (``apply_chat_template``),
shown by the greedy answer, whole and streamed, being the greedy completion of those token ids (and
not of the rendering without the generation prompt), with ``usage.prompt_tokens`` their count (not
one more: the rendered text is encoded without adding another ``<s>``). The same checkpoint without a template refuses chat with the
documented 400 (``no_chat_template``, naming the file) and still serves completions."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import pytest

from tests.backend.hf.builders import save_hf_model, save_tokenizer
from tests.compiler.online.server_proc import ServerProc
from tests.lazy import lazy

if TYPE_CHECKING:
    import openai
    from openai.types.chat import ChatCompletionMessageParam
else:
    openai = lazy("openai")  # (a second to import: only the worker that runs these tests pays it)

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f(x):\n    return"}]
NEW = 16


@attrs.frozen
class Checkpoints:
    chat: ServerProc
    """Serving the checkpoint with ``TEMPLATE``."""
    plain: ServerProc
    """Serving the same checkpoint without a chat template."""
    plain_dir: Path
    rendered: list[int]
    """``MESSAGES`` through transformers' ``apply_chat_template`` (generation prompt added), token ids."""
    unprompted: list[int]
    """The same without the generation prompt."""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Checkpoints]:
    from transformers import PreTrainedTokenizerFast

    chat_dir, plain_dir = tmp_path_factory.mktemp("chat") / "model", tmp_path_factory.mktemp("plain") / "model"
    chat_dir.mkdir()
    save_hf_model("granitemoehybrid", chat_dir, seed=7, vocab_size=320)
    save_tokenizer(chat_dir)
    shutil.copytree(chat_dir, plain_dir)
    specials = {"bos_token": "<s>", "eos_token": "</s>"}
    (chat_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, **specials}))
    (plain_dir / "tokenizer_config.json").write_text(json.dumps(specials))
    servers = [ServerProc(["--model", str(d), "--served-model-name", "m"]) for d in (chat_dir, plain_dir)]
    try:
        tok = PreTrainedTokenizerFast.from_pretrained(str(chat_dir))
        rendered, unprompted = (
            [int(t) for t in tok.apply_chat_template(MESSAGES, add_generation_prompt=g, tokenize=True, return_dict=True)["input_ids"]]
            for g in (True, False)
        )
        yield Checkpoints(servers[0].ready(), servers[1].ready(), plain_dir, rendered, unprompted)
    finally:
        for s in servers:
            s.stop()


def _client(server: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def test_chat_prompts_are_the_templates_rendering_whole_or_streamed(served: Checkpoints) -> None:
    client = _client(served.chat)
    ids = served.rendered
    assert ids[0] == 1 and ids.count(2) == len(MESSAGES)  # (<s> once, each turn's </s>: the template's specials as special tokens)
    wanted = client.completions.create(model="m", prompt=ids, max_tokens=NEW, temperature=0)
    other = client.completions.create(model="m", prompt=served.unprompted, max_tokens=NEW, temperature=0)
    assert len(served.unprompted) < len(ids) and other.choices[0].text != wanted.choices[0].text  # (the answer tells the prompts apart)

    whole = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=NEW, temperature=0)
    assert whole.choices[0].message.content == wanted.choices[0].text
    assert whole.choices[0].finish_reason == wanted.choices[0].finish_reason
    assert whole.usage is not None and wanted.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), wanted.usage.completion_tokens)

    pieces, reasons, usage = [], [], None
    for chunk in client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=NEW, temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            reasons.append(chunk.choices[0].finish_reason)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == wanted.choices[0].text and reasons[-1] == wanted.choices[0].finish_reason
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (len(ids), wanted.usage.completion_tokens)


def test_a_checkpoint_without_a_template_refuses_chat_naming_its_config(served: Checkpoints) -> None:
    client = _client(served.plain)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=NEW)
    error = caught.value.body
    assert isinstance(error, dict)
    assert (error["param"], error["code"], error["type"]) == ("messages", "no_chat_template", "invalid_request_error")
    assert error["message"] == (f"the model 'm' has no chat template ({served.plain_dir}/tokenizer_config.json has no chat_template): "
                                "use /v1/completions")
    done = client.completions.create(model="m", prompt=served.rendered, max_tokens=NEW, temperature=0)
    assert done.choices[0].text == _client(served.chat).completions.create(model="m", prompt=served.rendered, max_tokens=NEW,
                                                                          temperature=0).choices[0].text
