"""llama.cpp's tensor table and how hoist classifies weights with it: every architecture's
every tensor kind, hand-checked entries read from llama-arch.cpp, gguf-py's tensor names as
an independent check of the templates, the generator against the vendored llama.cpp source
(and against small made-up source trees), and plans that follow the table (T5's encoder
and decoder blocks offloaded, unused tensors ignored, tied output only where llama.cpp ties)."""

from __future__ import annotations

import asyncio
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from service.cli import devices_for, parse_args, placement_params
from service.loader.pipeline import load_model
from service.loader.placement import MemorySnapshot, Plan, plan
from service.loader.tensor_classes import UNUSED_OP, LayerClass, classify, table_for
from service.loader.tensor_table import ARCHITECTURES, KINDS, LORA_EXPERTS, SUFFIXES, TIED_OUTPUT
from service.loader.weights import open_model
from tests.helpers import write_fixture
from tests.llama_src import require_llama_cpp

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "tensor_table.py"

R, IN, OUT = LayerClass.REPEATING, LayerClass.INPUT, LayerClass.OUTPUT


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tensor_table_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _fill(template: str, bid: int = 7, xid: int = 3) -> str:
    """llama.cpp's ``format(template, bid, xid)``."""
    return template.replace("%d", str(bid), 1).replace("%d", str(xid), 1)


# -- the checked-in table ----------------------------------------------------------------


def test_table_invariants() -> None:
    assert len(ARCHITECTURES) > 100 and len(KINDS) > 250
    assert {"weight", "bias"} <= set(SUFFIXES)
    assert TIED_OUTPUT <= ARCHITECTURES.keys() and LORA_EXPERTS <= ARCHITECTURES.keys()
    for kind, (template, layer, op) in KINDS.items():
        assert template.count("%d") <= 2, kind
        assert not any(part.isdigit() for part in template.split(".")), kind
        assert (layer is None) == (op is None), kind
        assert layer in (None, "input", "output", "repeating"), kind
    for arch, kinds in ARCHITECTURES.items():
        assert list(kinds) == sorted(set(kinds)), arch
        spelled: dict[str, tuple[str | None, str | None]] = {}
        for kind in kinds:
            template, layer, op = KINDS[kind]
            # llama.cpp aborts on an input/output tensor built with a layer number
            assert layer is not None, (arch, kind)
            if layer != "repeating":
                assert "%d" not in template, (arch, kind)
            for name in (template, *(f"{template}.{s}" for s in SUFFIXES)):
                assert spelled.setdefault(name, (layer, op)) == (layer, op), (arch, name)
    # every architecture that has a loader has token embeddings, except the quantize-only stub
    assert [a for a, kinds in ARCHITECTURES.items() if "TOKEN_EMBD" not in kinds] == ["clip"]


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_kind_of_every_architecture(arch: str) -> None:
    table = table_for(arch)
    assert table.known
    assert table.tied_output == (arch in TIED_OUTPUT)
    for kind in ARCHITECTURES[arch]:
        template, layer, op = KINDS[kind]
        assert layer is not None and op is not None
        expected_block = (7 if "%d" in template else 0) if layer == "repeating" else None
        for suffix in (None, "weight", "bias", "scale", "lora_a"):
            name = _fill(template) + ("" if suffix is None else f".{suffix}")
            got = classify(name, arch)
            want_op = op
            if op == UNUSED_OP:
                pass  # ignored whatever its suffix
            elif suffix == "bias":
                want_op = "ADD_ID" if op == "MUL_MAT_ID" else "ADD"
            elif suffix == "lora_a" and arch in LORA_EXPERTS:
                want_op = "MUL_MAT_ID"
            assert (got.layer_class.value, got.op, got.block, got.kind, got.source) == (
                layer, want_op, expected_block, kind, "architecture"
            ), name  # fmt: skip


# entries read from llama-arch.cpp (LLM_TENSOR_NAMES / LLM_TENSOR_INFOS) and the
# architectures' load_arch_tensors at llama.cpp 0c1e570
HAND_CHECKED = [
    ("t5", "enc.blk.3.attn_q.weight", R, "MUL_MAT", 3),
    ("t5", "enc.blk.0.attn_rel_b.weight", R, "GET_ROWS", 0),
    ("t5", "dec.blk.5.ffn_norm.weight", R, "MUL", 5),
    ("t5", "dec.blk.2.cross_attn_o.weight", R, "MUL_MAT", 2),
    ("t5", "dec.blk.1.cross_attn_rel_b.weight", R, UNUSED_OP, 1),
    ("t5", "enc.output_norm.weight", OUT, "MUL", None),
    ("t5", "dec.output_norm.weight", OUT, "MUL", None),
    ("t5encoder", "enc.blk.11.ffn_up.weight", R, "MUL_MAT", 11),
    ("gemma3n", "altup_proj.weight", OUT, "MUL_MAT", None),
    ("gemma3n", "altup_unembd_proj.weight", OUT, "MUL_MAT", None),
    ("gemma3n", "per_layer_model_proj.weight", R, "MUL_MAT", 0),
    ("gemma3n", "per_layer_proj_norm.weight", R, "MUL", 0),
    ("gemma3n", "per_layer_token_embd.weight", IN, "GET_ROWS", None),
    ("gemma3n", "blk.4.altup_correct_coef.weight", R, "MUL_MAT", 4),
    ("gemma3n", "blk.4.altup_correct_scale.weight", R, "MUL", 4),
    ("gemma3n", "blk.4.altup_router_norm.weight", R, "MUL", 4),
    ("gemma3n", "blk.9.laurel_l.weight", R, "MUL_MAT", 9),
    ("gemma3", "dense_2.weight", OUT, "MUL_MAT", None),
    ("gemma-embedding", "dense_3.weight", OUT, "MUL_MAT", None),
    ("modern-bert", "cls.norm.weight", OUT, "MUL", None),
    ("bert", "cls.output.bias", OUT, "ADD", None),
    ("bert", "token_embd_norm.weight", R, "MUL", 0),
    ("lfm2", "token_embd_norm.weight", OUT, "MUL", None),
    ("glm4moe", "blk.46.nextn.eh_proj.weight", R, "MUL_MAT", 46),
    ("glm4moe", "blk.46.nextn.embed_tokens.weight", R, "GET_ROWS", 46),
    ("glm4moe", "blk.46.nextn.shared_head_norm.weight", R, "MUL", 46),
    ("gemma4-assistant", "nextn.pre_projection.weight", R, "MUL_MAT", 0),
    ("gemma4-assistant", "nextn.post_projection.weight", OUT, "MUL_MAT", None),
    ("wavtokenizer-dec", "posnet.2.conv1.weight", R, "IM2COL", 2),
    ("wavtokenizer-dec", "posnet.4.attn_q.bias", R, "ADD", 4),
    ("wavtokenizer-dec", "convnext.1.pw1.weight", R, "MUL_MAT", 1),
    ("wavtokenizer-dec", "convnext.1.gamma.weight", R, "MUL", 1),
    ("wavtokenizer-dec", "conv1d.weight", R, "IM2COL", 0),
    ("gpt-oss", "blk.2.ffn_down_exps.bias", R, "ADD_ID", 2),
    ("gpt-oss", "blk.2.attn_sinks.weight", R, "SCALE", 2),
    ("mamba", "blk.1.ssm_a", R, "SSM_SCAN", 1),
    ("qwen3next", "blk.1.ssm_a", R, "MUL", 1),
    ("rwkv6", "blk.0.time_mix_first.weight", R, "RWKV_WKV6", 0),
    ("hrm_text", "hrm.z_l_init", R, "ADD", 0),
    ("llama", "rope_freqs.weight", R, "ROPE", 0),
    ("llama", "token_embd.weight", IN, "GET_ROWS", None),
    ("llama", "output.weight", OUT, "MUL_MAT", None),
    ("llama", "blk.12.ffn_gate_exps.weight", R, "MUL_MAT_ID", 12),
    ("graniteswitch", "blk.0.attn_q.lora_b", R, "MUL_MAT_ID", 0),
    ("granite", "blk.0.attn_q.weight", R, "MUL_MAT", 0),
]


@pytest.mark.parametrize(("arch", "name", "layer_class", "op", "block"), HAND_CHECKED)
def test_hand_checked_entries(arch: str, name: str, layer_class: LayerClass, op: str, block: int | None) -> None:
    got = classify(name, arch)
    assert (got.layer_class, got.op, got.block, got.source) == (layer_class, op, block, "architecture")


def test_templates_agree_with_gguf_py() -> None:
    """gguf-py names the same tensor kinds (``MODEL_TENSOR``) with the same templates."""
    names = gguf.constants.TENSOR_NAMES
    # gguf-py spells these per-expert and activation-scale tensors differently
    differ = {"FFN_ACT", "FFN_GATE_EXP", "FFN_DOWN_EXP", "FFN_UP_EXP"}
    compared = 0
    for kind, (template, _, _) in KINDS.items():
        member = getattr(gguf.MODEL_TENSOR, kind, None)
        if member is None or member not in names or kind in differ:
            continue
        assert names[member].replace("{bid}", "%d").replace("{xid}", "%d") == template, kind
        compared += 1
    assert compared > 150
    # and gguf-py's T5 tensors are all T5 tensors for llama.cpp
    t5 = gguf.MODEL_ARCH.T5
    for member in gguf.constants.MODEL_TENSORS[t5]:
        assert member.name in ARCHITECTURES["t5"], member
    assert gguf.MODEL_ARCH_NAMES[t5] == "t5"


def test_unknown_architecture_and_strays() -> None:
    # an unknown architecture: any table's spelling, then name rules
    assert classify("enc.blk.2.attn_k.weight", "no-such-arch").block == 2
    assert classify("enc.blk.2.attn_k.weight", None).source == "table"
    assert classify("token_embd_norm.weight", None).layer_class is R  # more architectures use it so
    odd = classify("blk.3.my_norm.weight", "no-such-arch")
    assert (odd.layer_class, odd.op, odd.block, odd.source) == (R, "MUL", 3, "names")
    top = classify("my_table.weight", "llama")
    assert (top.layer_class, top.op, top.block, top.source) == (IN, "GET_ROWS", None, "names")
    assert not table_for("no-such-arch").known and table_for("no-such-arch").tied_output
    # known architecture, a tensor it never creates: decided by the other tables
    stray = classify("enc.blk.1.attn_q.weight", "llama")
    assert (stray.layer_class, stray.block, stray.kind, stray.source) == (R, 1, "ENC_ATTN_Q", "table")
    # a huge layer number is bounded before it is converted
    assert classify("blk." + "9" * 5000 + ".attn_q.weight", "llama").block == 10**18


# -- the generator ----------------------------------------------------------------------


def test_generated_table_matches_vendored_source() -> None:
    tree = require_llama_cpp()
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(tree), "--check"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def _mini_tree(root: Path, *, infos_extra: str = "") -> Path:
    (root / "src" / "models").mkdir(parents=True)
    (root / "src" / "llama-arch.cpp").write_text(
        "static const std::map<llm_arch, const char *> LLM_ARCH_NAMES = {\n"
        '    { LLM_ARCH_FOO, "foo" },\n    { LLM_ARCH_BAR, "bar" }, // a comment\n'
        '    { LLM_ARCH_UNKNOWN, "(unknown)" },\n};\n'
        "static const std::map<llm_tensor, const char *> LLM_TENSOR_NAMES = {\n"
        '    { LLM_TENSOR_TOKEN_EMBD, "token_embd" },\n'
        '    { LLM_TENSOR_OUTPUT, "output" },\n'
        '    { LLM_TENSOR_ATTN_Q, "blk.%d.attn_q" },\n'
        '    { LLM_TENSOR_ATTN_K, "blk.%d.attn_k" },\n'
        '    { LLM_TENSOR_ENC_FFN_UP, "enc.blk.%d.ffn_up" },\n'
        '    { LLM_TENSOR_ROT, "blk.%d.rot" },\n};\n'
        "static const std::map<llm_tensor, llm_tensor_info> LLM_TENSOR_INFOS = {\n"
        "    {LLM_TENSOR_TOKEN_EMBD, {LLM_TENSOR_LAYER_INPUT,     GGML_OP_GET_ROWS}},\n"
        "    {LLM_TENSOR_OUTPUT,     {LLM_TENSOR_LAYER_OUTPUT,    GGML_OP_MUL_MAT}},\n"
        "    /* block comment */\n"
        "    {LLM_TENSOR_ATTN_Q,     {LLM_TENSOR_LAYER_REPEATING, GGML_OP_MUL_MAT}},\n"
        "    {LLM_TENSOR_ATTN_K,     {LLM_TENSOR_LAYER_REPEATING, GGML_OP_MUL_MAT}},\n"
        f"    {{LLM_TENSOR_ENC_FFN_UP, {{LLM_TENSOR_LAYER_REPEATING, GGML_OP_NONE}}}},\n{infos_extra}}};\n"
    )
    (root / "src" / "llama-model.cpp").write_text(
        "static llama_model * llama_model_mapping(llm_arch arch, const llama_model_params & params) {\n"
        "    switch (arch) {\n        case LLM_ARCH_FOO:\n            return new llama_model_foo(params);\n"
        "        case LLM_ARCH_BAR:\n            return new llama_model_bar(params);\n"
        '        default:\n            throw std::runtime_error("no");\n    }\n}\n'
        "void llama_model_base::create_tensor_qkv(llama_layer & layer, int bid) {\n"
        '    create_tensor(tn(LLM_TENSOR_ATTN_K, "weight", bid), {1}, 0);\n}\n'
    )
    (root / "src" / "models" / "models.h").write_text(
        "struct llama_model_foo : public llama_model_base {};\nstruct llama_model_bar : public llama_model_foo {};\n"
    )
    (root / "src" / "models" / "foo.cpp").write_text(
        "void llama_model_foo::load_arch_tensors(llama_model_loader &) {\n"
        '    tok_embd = create_tensor(tn(LLM_TENSOR_TOKEN_EMBD, "weight"), {1}, 0);\n'
        '    if (x) { throw std::runtime_error("a } in a string"); }\n'
        '    output = create_tensor(tn(LLM_TENSOR_TOKEN_EMBD, "weight"), {1}, TENSOR_DUPLICATED);\n'
        "    // LLM_TENSOR_ROT is only mentioned in a comment\n"
        '    layer.wq = create_tensor(tn(LLM_TENSOR_ATTN_Q, "weight", i), {1}, 0);\n'
        "    create_tensor_qkv(layer, i);\n}\n"
        "void llama_model_foo::load_arch_hparams(llama_model_loader &) { hparams.router_layer = 3; }\n"
    )
    return root


def test_generator_on_a_made_up_tree(tmp_path: Path) -> None:
    gen = _generator()
    table = gen.parse(_mini_tree(tmp_path / "ok"))
    assert table.kinds["ATTN_Q"] == ("blk.%d.attn_q", "repeating", "MUL_MAT")
    assert table.kinds["ENC_FFN_UP"] == ("enc.blk.%d.ffn_up", "repeating", "NONE")
    assert table.kinds["ROT"] == ("blk.%d.rot", None, None)
    # bar reuses foo's loader; the helper's kinds count; comments do not
    assert table.archs == {"foo": ("ATTN_K", "ATTN_Q", "TOKEN_EMBD"), "bar": ("ATTN_K", "ATTN_Q", "TOKEN_EMBD")}
    assert table.tied == ("bar", "foo") and table.lora_experts == ("bar", "foo")
    assert table.suffixes == ("weight",)
    text = gen.render(table)
    namespace: dict[str, object] = {}
    exec(compile(text, "tensor_table.py", "exec"), namespace)
    assert namespace["ARCHITECTURES"] == table.archs and namespace["SUFFIXES"] == ("weight",)
    # --check compares, and the written module is what render gives
    out = tmp_path / "table.py"
    run = [sys.executable, str(SCRIPT), str(tmp_path / "ok"), "--output", str(out)]
    assert subprocess.run([*run, "--check"], capture_output=True, timeout=60).returncode == 1
    assert subprocess.run(run, capture_output=True, timeout=60).returncode == 0
    assert out.read_text() == text
    assert subprocess.run([*run, "--check"], capture_output=True, timeout=60).returncode == 0


def test_generator_fails_loudly_on_a_changed_layout(tmp_path: Path) -> None:
    gen = _generator()
    root = _mini_tree(tmp_path / "bad", infos_extra="    LLM_TENSOR_INFO(ATTN_V, REPEATING, MUL_MAT),\n")
    with pytest.raises(gen.LayoutError, match=re.escape("unexpected line in")):
        gen.parse(root)
    result = subprocess.run([sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "LLM_TENSOR_INFO(ATTN_V" in result.stderr
    with pytest.raises(gen.LayoutError, match="llama-arch.cpp"):
        gen.parse(tmp_path / "missing")


# -- plans that follow the table -----------------------------------------------------------

N_EMBD, N_FF, N_VOCAB, N_LAYER = 64, 128, 256, 3


def _t5_tensors(rng: np.random.Generator, *, unused: bool) -> dict[str, tuple[np.ndarray, Q]]:
    def mat(rows: int, cols: int) -> tuple[np.ndarray, Q]:
        return rng.standard_normal((rows, cols)).astype(np.float16), Q.F16

    def vec(n: int) -> tuple[np.ndarray, Q]:
        return rng.standard_normal(n).astype(np.float32), Q.F32

    t = {"token_embd.weight": mat(N_VOCAB, N_EMBD)}
    for i in range(N_LAYER):
        e, d = f"enc.blk.{i}", f"dec.blk.{i}"
        t[f"{e}.attn_norm.weight"] = vec(N_EMBD)
        for w in ("attn_q", "attn_k", "attn_v", "attn_o"):
            t[f"{e}.{w}.weight"] = mat(N_EMBD, N_EMBD)
        t[f"{e}.ffn_norm.weight"] = vec(N_EMBD)
        t[f"{e}.ffn_up.weight"] = mat(N_FF, N_EMBD)
        t[f"{e}.ffn_down.weight"] = mat(N_EMBD, N_FF)
        t[f"{d}.attn_norm.weight"] = vec(N_EMBD)
        t[f"{d}.cross_attn_norm.weight"] = vec(N_EMBD)
        for w in ("attn_q", "attn_k", "attn_v", "attn_o", "cross_attn_q", "cross_attn_k", "cross_attn_v"):
            t[f"{d}.{w}.weight"] = mat(N_EMBD, N_EMBD)
        t[f"{d}.cross_attn_o.weight"] = mat(N_EMBD, N_EMBD)
        t[f"{d}.ffn_norm.weight"] = vec(N_EMBD)
        t[f"{d}.ffn_up.weight"] = mat(N_FF, N_EMBD)
        t[f"{d}.ffn_down.weight"] = mat(N_EMBD, N_FF)
    t["enc.blk.0.attn_rel_b.weight"] = mat(32, 4)
    t["dec.blk.0.attn_rel_b.weight"] = mat(32, 4)
    if unused:
        t["dec.blk.0.cross_attn_rel_b.weight"] = mat(32, 4)
    t["enc.output_norm.weight"] = vec(N_EMBD)
    t["dec.output_norm.weight"] = vec(N_EMBD)
    return t


def _write(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, Q]]) -> Path:
    kv = [
        (f"{arch}.block_count", N_LAYER, V.UINT32, None),
        (f"{arch}.embedding_length", N_EMBD, V.UINT32, None),
        (f"{arch}.feed_forward_length", N_FF, V.UINT32, None),
        (f"{arch}.attention.head_count", 4, V.UINT32, None),
        (f"{arch}.attention.layer_norm_rms_epsilon", 1e-6, V.FLOAT32, None),
        (f"{arch}.attention.relative_buckets_count", 32, V.UINT32, None),
        (f"{arch}.decoder_block_count", N_LAYER, V.UINT32, None),
    ]
    return write_fixture(path, kv=kv, tensors=tensors, arch=arch).path


def _plan(path: Path, *flags: str) -> Plan:
    args = parse_args(["plan", str(path), "--no-cuda", "--emulated-devices", "EMU0=1GiB", *flags])
    devices = devices_for(args)
    return plan(open_model(path), devices, placement_params(args, devices), memory=MemorySnapshot.take(devices))


def test_t5_offloads_encoder_and_decoder_blocks(tmp_path: Path) -> None:
    path = _write(tmp_path / "t5.gguf", "t5", _t5_tensors(np.random.default_rng(5), unused=True))
    p = _plan(path, "-ngl", "99")
    placed = {t.name: t for t in p.tensors if t.role == "weight"}
    assert p.n_layer == N_LAYER
    assert p.layers == {"input": "CPU", **{f"blk.{i}": "EMU0" for i in range(N_LAYER)}, "output": "EMU0"}
    blocks = [t for t in p.tensors if t.name.startswith(("enc.blk.", "dec.blk."))]
    assert len(blocks) == 8 * N_LAYER + 13 * N_LAYER + 2
    for t in blocks:
        assert (t.device, t.layer_class) == ("EMU0", "repeating"), t.name
        assert t.layer == "blk." + t.name.split(".")[2]
    assert placed["enc.blk.0.attn_rel_b.weight"].op == "GET_ROWS"
    assert placed["enc.output_norm.weight"].device == placed["dec.output_norm.weight"].device == "EMU0"
    assert placed["token_embd.weight"].device == "CPU"
    # no output.weight: T5 reuses token_embd as its output weight, a copy on the device
    tied = [t for t in p.tensors if t.role == "tied_output"]
    assert [(t.name, t.device) for t in tied] == [("token_embd.weight", "EMU0")]
    # the unused tensor is ignored, as llama.cpp does
    assert "dec.blk.0.cross_attn_rel_b.weight" not in placed
    assert any(w.startswith("model has unused tensor dec.blk.0.cross_attn_rel_b.weight") for w in p.warnings)
    assert not any("loader creates" in w or "cannot load" in w for w in p.warnings)
    emu = next(b for b in p.buffers if b.name == "EMU0")
    assert emu.nbytes == sum(t.nbytes for t in p.tensors if t.buffer_type == "EMU0")


def test_t5_layer_index_picks_the_device(tmp_path: Path) -> None:
    path = _write(tmp_path / "t5.gguf", "t5", _t5_tensors(np.random.default_rng(6), unused=False))
    # -ngl 2: the output layer and the last block on the device
    p = _plan(path, "-ngl", "2")
    for t in p.tensors:
        if t.name.startswith(("enc.blk.", "dec.blk.")):
            want = "EMU0" if t.name.split(".")[2] == str(N_LAYER - 1) else "CPU"
            assert t.device == want, t.name
    assert not any("unused" in w for w in p.warnings)


def test_untied_architecture_and_strays(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    tensors = {
        "token_embd.weight": (rng.standard_normal((N_VOCAB, N_EMBD)).astype(np.float16), Q.F16),
        "token_embd_norm.weight": (rng.standard_normal(N_EMBD).astype(np.float32), Q.F32),
        "blk.0.attn_output.weight": (rng.standard_normal((N_EMBD, N_EMBD)).astype(np.float16), Q.F16),
        "blk.1.attn_output.weight": (rng.standard_normal((N_EMBD, N_EMBD)).astype(np.float16), Q.F16),
        "blk.2.attn_output.weight": (rng.standard_normal((N_EMBD, N_EMBD)).astype(np.float16), Q.F16),
        "blk.2.extra.weight": (rng.standard_normal((N_EMBD, N_EMBD)).astype(np.float16), Q.F16),
    }
    # BERT never uses token_embd as an output weight: no copy on the device
    p = _plan(_write(tmp_path / "bert.gguf", "bert", tensors), "-ngl", "99")
    assert not any(t.role == "tied_output" for t in p.tensors)
    placed = {t.name: t for t in p.tensors if t.role == "weight"}
    assert (placed["token_embd_norm.weight"].layer, placed["token_embd_norm.weight"].device) == ("blk.0", "EMU0")
    assert placed["blk.2.extra.weight"].device == "EMU0"
    assert any("'blk.2.extra.weight'" in w and "'bert' loader" in w for w in p.warnings)
    # an unknown architecture: classified by name, with a warning; token_embd tied as before
    p = _plan(_write(tmp_path / "odd.gguf", "odd", tensors), "-ngl", "99")
    assert any("architecture 'odd'" in w and "cannot load" in w for w in p.warnings)
    assert [t.device for t in p.tensors if t.role == "tied_output"] == ["EMU0"]


@pytest.mark.parametrize("load_mode", ["mmap", "none"])
def test_t5_loads_as_planned(tmp_path: Path, load_mode: str) -> None:
    path = _write(tmp_path / "t5.gguf", "t5", _t5_tensors(np.random.default_rng(8), unused=True))
    args = parse_args(
        ["plan", str(path), "--no-cuda", "--emulated-devices", "EMU0=1GiB", "-ngl", "99", "--load-mode", load_mode]
    )
    devices = devices_for(args)
    index = open_model(path)
    raw = path.read_bytes()
    with asyncio.run(load_model(index, devices=devices, params=placement_params(args, devices))) as model:
        assert "dec.blk.0.cross_attn_rel_b.weight" not in model.tensors
        assert set(model.tensors) == set(index.weights) - {"dec.blk.0.cross_attn_rel_b.weight"}
        for name in ("enc.blk.2.attn_q.weight", "dec.blk.1.cross_attn_o.weight", "dec.output_norm.weight"):
            t = model.tensors[name]
            assert t.device == "EMU0"
            w = index[name]
            assert t.data.tobytes() == raw[w.offset : w.end]
        assert model.tied_output is not None and model.tied_output.device == "EMU0"


def test_kept_classes_are_the_computed_ones_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import service.loader.tensor_classes as tc

    table = tc.ArchitectureTable("llama", True, dict(table_for("llama").templates), False, False)
    names = ["token_embd.weight", "blk.3.attn_q.weight", "blk.3.ffn_up_exps.weight", "mystery.weight"]
    monkeypatch.setattr(tc, "CLASSIFIED_KEPT", 2)
    first = [table.classify(n) for n in names]
    assert first == [table.classify(n) for n in names] == [table._classify(n) for n in names]
    assert len(table._seen) == 2 and len(table._by_template) == 2
    # the shared table answers as a fresh one does
    assert [table_for("llama").classify(n) for n in names] == first


def test_names_sharing_a_template_keep_their_own_number_and_suffix() -> None:
    """A table decides each name template once; every name spelled with it still gets its
    own layer number and its suffix's op, whatever was classified before it."""
    import service.loader.tensor_classes as tc

    expected = {
        "blk.3.attn_q.weight": (R, "MUL_MAT", 3, "ATTN_Q", "architecture"),
        "blk.5.attn_q.weight": (R, "MUL_MAT", 5, "ATTN_Q", "architecture"),
        "blk.3.attn_q.bias": (R, "ADD", 3, "ATTN_Q", "architecture"),
        "blk.07.ffn_gate_exps.weight": (R, "MUL_MAT_ID", 7, "FFN_GATE_EXPS", "architecture"),
        "blk.7.ffn_gate_exps.bias": (R, "ADD_ID", 7, "FFN_GATE_EXPS", "architecture"),
        # a literal %d is no layer number: the kind's layer 0
        "blk.%d.attn_q.weight": (R, "MUL_MAT", 0, "ATTN_Q", "architecture"),
        # digits other than ASCII are no layer number either: not in any table, not blk.N
        "blk.\u0663.attn_q.weight": (IN, "GET_ROWS", None, None, "names"),
        "blk.2.my_norm.weight": (R, "MUL", 2, None, "names"),
        "blk.4.my_norm.weight": (R, "MUL", 4, None, "names"),
        "enc.blk.1.attn_q.weight": (R, "MUL_MAT", 1, "ENC_ATTN_Q", "table"),
        "enc.blk.6.attn_q.weight": (R, "MUL_MAT", 6, "ENC_ATTN_Q", "table"),
    }
    assert table_for("llama").templates["blk.%d.ffn_gate_exps"] == "FFN_GATE_EXPS"
    for order in (list(expected), list(reversed(expected))):
        table = tc.ArchitectureTable("llama", True, dict(table_for("llama").templates), False, False)
        for name in order:
            got = table.classify(name)
            assert (got.layer_class, got.op, got.block, got.kind, got.source) == expected[name], name
