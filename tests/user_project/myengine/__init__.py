"""An engine of one's own on batchc: a pass and an engine loop written against batchc's public API."""
