"""Loading untrusted model folders: no code from a model folder runs, only the files the model needs
are read, and a damaged folder is one error line."""
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest

from snapcompile.artifact.manifest import MANIFEST
from tests.cli_helpers import Marker, assert_one_line_error, invoke, rerecord_checksums

REPO = Path(__file__).resolve().parents[1]


def test_weights_load_from_safetensors_whatever_the_index_says(hf_copy, tmp_path):
    marker = tmp_path / "pickle-ran"
    with open(hf_copy / "pytorch_model.bin", "wb") as handle:
        pickle.dump(Marker(marker), handle)
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "pytorch_model.bin"}}
    (hf_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    result = invoke("export", hf_copy, "-o", tmp_path / "out", "--max-context", 256, "--chunk", 64)
    assert result.exit_code == 0, result.output
    assert not marker.exists()
    (hf_copy / "model.safetensors").unlink()               # only the pickle is left
    assert_one_line_error(invoke("export", hf_copy, "-o", tmp_path / "o2"), "no *.safetensors")
    shutil.copy(hf_copy / "pytorch_model.bin", hf_copy / "model.safetensors")   # a pickle by another name
    assert_one_line_error(invoke("export", hf_copy, "-o", tmp_path / "o2"), "is not a valid safetensors file")
    assert not marker.exists() and not (tmp_path / "o2").exists()


@pytest.mark.parametrize("config_file", ["config.json", "tokenizer_config.json"])
def test_remote_code_is_refused_even_when_the_user_says_yes(hf_copy, tmp_path, config_file):
    marker = tmp_path / "code-ran"
    (hf_copy / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    edit_manifest_like = json.loads((hf_copy / config_file).read_text())
    edit_manifest_like["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoTokenizer": ["evil.EvilTokenizer", None],
                                      "AutoModelForCausalLM": "evil.EvilModel"}
    (hf_copy / config_file).write_text(json.dumps(edit_manifest_like))
    result = invoke("convert", hf_copy, "-o", tmp_path / "out", "--budget", 64, "--window", 8, input="y\ny\ny\n")
    assert_one_line_error(result, "never executes code from a model folder")
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_artifact_asking_for_remote_code_is_refused(artifact, tmp_path):
    marker = tmp_path / "code-ran"
    (artifact / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    config = json.loads((artifact / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    (artifact / "tokenizer_config.json").write_text(json.dumps(config))
    rerecord_checksums(artifact)
    for command in ("run", "validate"):
        assert_one_line_error(invoke(command, artifact, "--prompt", "hi", input="y\n"), "never executes code")
    assert not marker.exists()


def test_convert_copies_no_file_of_the_model_folder_but_its_tokenizer(hf_copy, tmp_path):
    (hf_copy / "helper.py").write_text("raise SystemExit('ran')\n")
    assert invoke("export", hf_copy, "-o", tmp_path / "dense", "--max-context", 256, "--chunk", 64).exit_code == 0
    assert invoke("compress", tmp_path / "dense", "-o", tmp_path / "snap", "--budget", 64, "--window", 8).exit_code == 0
    for folder in (tmp_path / "dense", tmp_path / "snap"):
        names = {p.name for p in folder.iterdir()}
        assert "helper.py" not in names and not any(n.endswith(".py") for n in names)
        assert names - {MANIFEST} == set(json.loads((folder / MANIFEST).read_text())["files"])


@pytest.mark.parametrize("damage, fragment", [
    (lambda m: os.truncate(m / "model.safetensors", 5000), "is not a valid safetensors file"),
    (lambda m: (m / "config.json").write_text("[1, 2]"), "config.json must hold a JSON object, not list"),
    (lambda m: _patch_config(m, num_attention_heads=0), "num_attention_heads must be a positive integer, got 0"),
    (lambda m: _patch_config(m, hidden_size="64"), "hidden_size must be a positive integer, got '64'"),
    (lambda m: _patch_config(m, num_hidden_layers=3),
     "it declares 3 layers (num_hidden_layers), the checkpoint holds 2 (model.layers.0 .. model.layers.1)"),
    (lambda m: _patch_config(m, num_hidden_layers=1000000), "it declares 1000000 layers"),
    (lambda m: _patch_config(m, intermediate_size=96),
     "down_proj.weight has shape [64, 128], the config needs [64, 96]"),
    (lambda m: (m / "config.json").write_bytes(b"\xff\xfe"), "config.json is not valid JSON"),
    (lambda m: _patch_config(m, eos_token_id="x"), "eos_token_id must be a token id"),
    (lambda m: _patch_config(m, rms_norm_eps="x"), "rms_norm_eps must be a number in (0, 1), got 'x'"),
    (lambda m: _patch_config(m, rms_norm_eps=float("nan")), "rms_norm_eps must be a number in (0, 1), got nan"),
    (lambda m: _patch_config(m, rms_norm_eps=-1e-5), "rms_norm_eps must be a number in (0, 1)"),
    (lambda m: _patch_config(m, tie_word_embeddings="yes"), "tie_word_embeddings must be true or false"),
    (lambda m: _patch_config(m, num_attention_heads=3), "num_attention_heads 3 is not a multiple of"),
    (lambda m: _patch_config(m, rope_scaling={"rope_type": "bogus"}), "rope_scaling must name a rope_type"),
    (lambda m: (m / "config.json").write_text("[" * 100000 + "]" * 100000), "config.json nests too deeply"),
    (lambda m: (m / "config.json").write_text('{"hidden_size": ' + "9" * 5000 + "}"), "config.json is not valid JSON"),
], ids=["truncated-safetensors", "config-list", "zero-heads", "string-size", "missing-layer", "huge-layers",
         "wrong-shape", "config-binary", "eos-string", "eps-string", "eps-nan", "eps-negative", "tie-string",
         "heads-not-dividing", "rope-bogus", "config-deep", "config-huge-int"])
def test_bad_model_files_are_one_error_line(hf_copy, tmp_path, damage, fragment):
    damage(hf_copy)
    assert_one_line_error(invoke("export", hf_copy, "-o", tmp_path / "out"), fragment)
    assert not (tmp_path / "out").exists()


def _with_tensor_info(source: Path, target: Path, name: str, **values) -> Path:
    """A copy of the GGUF `source` with tensor `name`'s type code or data offset (relative to the
    data section) changed in place; `offset_of` copies another tensor's offset."""
    import shutil

    import gguf
    shutil.copyfile(source, target)
    reader = gguf.GGUFReader(str(target), "r+")
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    parts = tensors[name].field.parts
    if "type" in values:
        parts[4][0] = values["type"]
    if "offset_of" in values:
        parts[5][0] = tensors[values["offset_of"]].field.parts[5][0]
    reader.data.flush()
    return target


@pytest.mark.slow
@pytest.mark.parametrize("lie, fragment", [
    (lambda s, t: _with_metadata(s, t, **{"llama.attention.layer_norm_rms_epsilon": float("nan")}),
     "rms_norm_eps must be a number in (0, 1), got nan"),
    (lambda s, t: _with_metadata(s, t, **{"llama.rope.freq_base": float("nan")}),
     "rotary embedding's frequencies are not finite positive numbers"),
    (lambda s, t: _with_metadata(s, t, **{"llama.rope.freq_base": -10000.0}),
     "rotary embedding's frequencies are not finite positive numbers"),
    (lambda s, t: _with_tensor_info(s, t, "blk.0.attn_k.weight", offset_of="blk.0.attn_q.weight"), "overlap"),
    (lambda s, t: _with_tensor_info(s, t, "blk.0.attn_q.weight", type=0), "overlap"),   # F32 over Q4_1 bytes
], ids=["eps-nan", "rope-nan", "rope-negative", "overlapping-tensors", "f32-over-quantized"])
def test_a_gguf_whose_numbers_lie_is_refused(tmp_path, lie, fragment):
    """The lies a Hugging Face folder's config cannot tell either: every field that changes the numbers
    is checked, whatever file it comes from."""
    from snapcompile.models.loader import _smollm2_gguf
    edited = lie(_smollm2_gguf(), tmp_path / "edited.gguf")
    assert_one_line_error(invoke("export", edited, "-o", tmp_path / "out", "--max-context", 256, "--chunk", 64),
                          fragment)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change, fragment", [
    (dict(rope_theta=float("nan")), "rope_theta must be a positive number"),
    (dict(rope_theta=-1.0), "rope_theta must be a positive number"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": -10000.0}), "rotary embedding's frequencies"),
])
def test_a_folder_whose_rope_lies_is_refused(hf_copy, tmp_path, change, fragment):
    config = json.loads((hf_copy / "config.json").read_text())
    config.pop("rope_theta", None)
    config.update(change)
    (hf_copy / "config.json").write_text(json.dumps(config))
    assert_one_line_error(invoke("export", hf_copy, "-o", tmp_path / "out"), fragment)


@pytest.mark.parametrize("held, count, expected", [
    (set(), 0, True), ({0, 1, 2}, 3, True), ({0, 1, 2}, 4, False), ({1, 2, 3}, 3, False), ({0, 2}, 2, False),
    ({0, 1}, 10 ** 18, False), ({0}, True, False), ({0}, "1", False), ({0}, None, False)])
def test_a_layer_count_is_compared_without_being_enumerated(held, count, expected):
    from snapcompile.models.tensors import holds_every_index
    assert holds_every_index(held, count) is expected


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_a_declared_layer_count_is_checked_against_the_file_before_anything_is_sized_by_it(hf_copy, tmp_path,
                                                                                          architecture):
    """10^12 layers: refused from the tensor names alone, under an address-space limit (today's machine
    must not be the bound), before transformers' config builds a list a layer (Qwen2's layer_types)."""
    import resource
    import subprocess
    import sys
    _patch_config(hf_copy, num_hidden_layers=10 ** 12, architectures=[architecture],
                  model_type=architecture[:-len("ForCausalLM")].lower())

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
    result = subprocess.run([sys.executable, "-m", "snapcompile.cli", "export", str(hf_copy), "-o",
                             str(tmp_path / "out")], capture_output=True, text=True, timeout=300, preexec_fn=limit)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "it declares 1000000000000 layers (num_hidden_layers)" in result.stderr
    assert "Traceback" not in result.stderr


def _patch_config(folder, **values):
    config = json.loads((folder / "config.json").read_text())
    config.update(values)
    (folder / "config.json").write_text(json.dumps(config))


def _tensorless_copy(source: Path, target: Path) -> None:
    """The GGUF `source` with every metadata field and no tensor."""
    import gguf
    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(target), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.slow
def test_a_gguf_without_its_tensors_is_refused_and_the_real_one_loads(tmp_path):
    from snapcompile.models.loader import _load_gguf, _smollm2_gguf
    empty = tmp_path / "empty.gguf"
    _tensorless_copy(_smollm2_gguf(), empty)
    assert_one_line_error(invoke("export", empty, "-o", tmp_path / "out", "--max-context", 256, "--chunk", 64),
                          "declares 30 layers (llama.block_count) but its tensors hold none")
    assert not (tmp_path / "out").exists()
    assert _load_gguf(_smollm2_gguf(), "smollm2").spec.num_layers == 30


def _with_metadata(source: Path, target: Path, **values) -> Path:
    """A copy of the GGUF `source` with integer metadata fields changed in place (as gguf's own
    gguf_set_metadata does)."""
    import shutil

    import gguf
    shutil.copyfile(source, target)
    reader = gguf.GGUFReader(str(target), "r+")
    for key, value in values.items():
        field = reader.fields[key]
        field.parts[field.data[0]][0] = value
    reader.data.flush()
    return target


@pytest.mark.slow
@pytest.mark.parametrize("key, value, fragment", [
    ("llama.block_count", 29, "declares 29 layers (llama.block_count) but its tensors hold 30 (blk.0 .. blk.29)"),
    ("llama.block_count", 31, "declares 31 layers"),
    ("llama.block_count", 4_000_000_000, "declares 4000000000 layers"),     # decided without sizing anything by it
    ("llama.attention.head_count_kv", 4, "declares 4 heads of 64 for blk.0.attn_k.weight"),
])
def test_a_gguf_whose_metadata_disagrees_with_its_tensors_is_refused(tmp_path, key, value, fragment):
    from snapcompile.models.loader import _smollm2_gguf
    edited = _with_metadata(_smollm2_gguf(), tmp_path / "edited.gguf", **{key: value})
    assert_one_line_error(invoke("export", edited, "-o", tmp_path / "out", "--max-context", 256, "--chunk", 64),
                          fragment)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name, params", [("random:llama-3.2-1b", 1.236e9), ("random:llama-3.1-8b", 8.03e9),
                                          ("random:qwen2.5-0.5b", 0.494e9), ("random:qwen3-0.6b", 0.596e9),
                                          ("random:qwen3-8b", 8.19e9), ("random:gemma-3-1b", 1.0e9)])
def test_random_shapes_have_the_published_sizes(name, params):
    """The built-in random-weight shapes hold as many parameters as the models they stand for
    (counted on the meta device: nothing allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    from snapcompile.models.loader import random_shape_config
    from snapcompile.models.spec import ModelSpec
    config = random_shape_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    count = sum(p.numel() for p in model.parameters())
    assert abs(count - params) / params < 0.01, count
    assert ModelSpec.from_hf_config(config).weight_bytes == pytest.approx(4 * count, rel=0.01)


def test_a_random_shape_loads_without_its_weights_and_is_not_built_where_it_cannot_fit():
    """Loading the 8B shape allocates nothing (its weights are generated tensor by tensor as an export
    reads them); building it in PyTorch (float32, 32 GB) is refused in one line where it cannot fit."""
    from snapcompile.bench.machine import rss_bytes
    from snapcompile.errors import SnapcompileError
    from snapcompile.memory import available_host_memory
    from snapcompile.models import load_model
    before = rss_bytes()
    loaded = load_model("random:llama-3.1-8b")
    assert rss_bytes() - before < 200 * 2**20 and len(loaded.tensors.shapes) == 2 + 32 * 9 + 1
    assert loaded.tensors.read("model.layers.31.mlp.down_proj.weight").shape == (4096, 14336)
    if loaded.spec.weight_bytes < available_host_memory():
        pytest.skip("this machine could build it")
    with pytest.raises(SnapcompileError, match="building this model in PyTorch"):
        _ = loaded.model
