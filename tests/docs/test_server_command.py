"""The docs' vLLM server command starts as written on a fresh CPU machine: every server command of
README.md and docs/ carries the settings a CPU machine needs (the KV cache size that lets two
servers share one machine, the weight-transfer routes, float32, eager mode), and the guide writes
the model directory it serves offline (``dcr_bench.models.servable``, in a run block that
``test_doc_snippets`` runs; what it leaves is checked by ``check_model_directory``). Real servers
started from the guide's blocks as written: ``tests/vllm/test_docs_servers.py`` (``make test-vllm``)."""

from __future__ import annotations

import json
import os
import re
import struct

from tests.docs.test_doc_snippets import BLOCKS

GUIDE = "docs/guides/vllm-fleets.md"
SERVER = "vllm.entrypoints.openai.api_server"
CPU_SETTINGS = ("VLLM_SERVER_DEV_MODE=1", "VLLM_CPU_KVCACHE_SPACE=1", "--dtype float32", "--enforce-eager",
                """--weight-transfer-config '{"backend": "dcr"}'""")


def test_every_server_command_of_the_docs_carries_the_cpu_settings():
    servers = [b for b in BLOCKS if SERVER in b.code and b.language in ("bash", "sh", "shell")]
    assert {"README.md", GUIDE} <= {b.page for b in servers}
    for b in servers:
        missing = [s for s in CPU_SETTINGS if s not in b.code]
        assert not missing, f"{b.page}:{b.line}: the server command lacks {missing}"


def test_the_guide_serves_the_model_directory_it_writes_offline():
    writes = [b for b in BLOCKS if b.page == GUIDE and b.language == "bash" and "python -m dcr_bench.models.servable" in b.code]
    assert [b.marker for b in writes] == ["run"]  # written here, in the default virtualenv
    out = re.search(r"--out (\S+)", writes[0].code).group(1)
    published = re.search(r"dcr publish (\S+) (\S+)", writes[0].code)
    assert published.group(2) == f"{out}/model.safetensors"
    (serve,) = [b for b in BLOCKS if b.page == GUIDE and SERVER in b.code and "dcr fleet" in b.code]
    assert serve.line > writes[0].line and re.search(r"--model (\S+)", serve.code).group(1) == out
    assert re.search(r"dcr fleet (\S+)", serve.code).group(1) == published.group(1)


def check_model_directory(directory: str) -> None:
    """What ``--model DIR`` needs, consistent: the config, a tokenizer whose vocabulary and special
    tokens are the model's, and the weights in one safetensors file of the config's shapes (read from
    the files alone: no transformers, no vLLM)."""
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(directory, "generation_config.json")) as f:
        generation = json.load(f)
    with open(os.path.join(directory, "tokenizer.json")) as f:
        tokenizer = json.load(f)
    with open(os.path.join(directory, "tokenizer_config.json")) as f:
        tokenizer_config = json.load(f)
    vocab = tokenizer["model"]["vocab"]
    assert config["architectures"] == ["LlamaForCausalLM"] and len(vocab) == config["vocab_size"]
    assert (vocab["<s>"], vocab["</s>"]) == (config["bos_token_id"], config["eos_token_id"])
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (vocab["<s>"], vocab["</s>"])
    assert (tokenizer_config["tokenizer_class"], tokenizer_config["bos_token"], tokenizer_config["eos_token"]) == (
        "PreTrainedTokenizerFast", "<s>", "</s>")
    with open(os.path.join(directory, "model.safetensors"), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    embed = header["model.embed_tokens.weight"]
    assert (embed["dtype"], embed["shape"]) == ("BF16", [config["vocab_size"], config["hidden_size"]])
    layers = {k.split(".")[2] for k in header if k.startswith("model.layers.")}
    assert len(layers) == config["num_hidden_layers"] and "lm_head.weight" in header


def test_the_model_directory_command_refuses_a_directory_that_holds_something(tmp_path, capsys):
    from dcr_bench.models import servable

    (tmp_path / "serve").mkdir()
    (tmp_path / "serve" / "config.json").write_text("{}")
    assert servable.main(["--out", str(tmp_path / "serve")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"servable: error: {tmp_path}/serve: exists and is not an empty")
    assert os.listdir(tmp_path / "serve") == ["config.json"]
