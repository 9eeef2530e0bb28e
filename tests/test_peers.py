"""HF transformers peers: a CPU smoke test on the tiny Llama (not a performance figure) and the hint paths."""
from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from atomflow_bench.cli import main  # noqa: E402
from atomflow_bench.config import ModelConfig  # noqa: E402
from atomflow_bench.errors import AtomflowError, GpuUnavailable  # noqa: E402
from atomflow_bench.measure.peers import HINT, measure_peers  # noqa: E402

CTX, TOKENS = 8, 6


@pytest.fixture(scope="module")
def cpu_records(tiny_llama_dir):
    return measure_peers(tiny_llama_dir, context=CTX, tokens=TOKENS, modes=("eager", "static"), device="cpu",
                         repeats=2)


def test_records_fields(cpu_records, tiny_llama_dir):
    import torch
    import transformers

    cfg = ModelConfig.from_file(tiny_llama_dir / "config.json")
    kv = int(round((CTX + (TOKENS - 1) / 2 + 1) * cfg.kv_bytes_per_token()))
    for rec, mode in zip(cpu_records, ("eager", "static")):
        assert rec["engine"] == f"HF transformers {transformers.__version__} {mode} fp16" and rec["mode"] == mode
        assert rec["framework"] == {"torch": torch.__version__, "transformers": transformers.__version__}
        assert "CUDNN_ATTENTION" not in rec["sdpa_backends"]
        assert rec["gpu"] == "cpu" and (rec["context"], rec["tokens"], rec["repeats"]) == (CTX, TOKENS, 2)
        tp = rec["tpot_ms"]
        assert tp["n"] == 2 * TOKENS and len(tp["repeat_medians"]) == 2
        assert 0 < tp["p10"] <= tp["median"] <= tp["p90"]
        assert rec["tok_per_s"] == pytest.approx(1e3 / tp["median"])
        assert rec["bytes_per_token"] == {"weights": cfg.weight_bytes("fp16"), "kv": kv,
                                          "total": cfg.weight_bytes("fp16") + kv}
        assert rec["bandwidth_gbs"] == pytest.approx(rec["bytes_per_token"]["total"] / tp["median"] / 1e6)
        assert len(rec["token_ids"]) == TOKENS + 1  # the prefill's token, then one per timed step


def test_static_cache_decodes_the_same_tokens_as_hf_generate(cpu_records, tiny_llama_dir):
    import torch
    from transformers import LlamaForCausalLM

    from atomflow_bench.measure.decode import synthetic_prompt

    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float16).eval()
    prompt = synthetic_prompt(model.config.vocab_size, CTX)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=TOKENS + 1, min_new_tokens=TOKENS + 1,
                         do_sample=False)
    expected = out[0, CTX:].tolist()
    assert [r["token_ids"] for r in cpu_records] == [expected, expected]
    assert all(r["same_tokens_as_first_mode"] for r in cpu_records)


@pytest.mark.slow
def test_compiled_mode_on_cpu(tiny_llama_dir, cpu_records):
    [rec] = measure_peers(tiny_llama_dir, context=CTX, tokens=TOKENS, modes=("compiled",), device="cpu", repeats=1,
                          warmup_steps=2)
    assert rec["mode"] == "compiled" and rec["token_ids"] == cpu_records[0]["token_ids"]


def test_decode_raises_no_future_warning(tiny_llama_dir):
    """The KV cache goes under the keyword this transformers declares: the other name warns on every step."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        recs = measure_peers(tiny_llama_dir, context=CTX, tokens=3, modes=("eager", "static"), device="cpu",
                             repeats=1)
    assert [len(r["token_ids"]) for r in recs] == [4, 4]


def test_cache_and_dtype_keywords_follow_the_installed_api():
    import inspect
    from types import SimpleNamespace

    from transformers import LlamaForCausalLM

    from atomflow_bench.hf import cache_keyword, dtype_keyword

    class Older:  # transformers 4.x's forward
        def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
            pass

    class Newer:
        def forward(self, input_ids=None, cache=None, use_cache=None, **kwargs):
            pass

    assert cache_keyword(Older()) == "past_key_values" and cache_keyword(Newer()) == "cache"
    declared = inspect.signature(LlamaForCausalLM.forward).parameters
    assert cache_keyword(LlamaForCausalLM) == ("cache" if "cache" in declared else "past_key_values")
    assert dtype_keyword(SimpleNamespace(__version__="4.45.2")) == "torch_dtype"
    assert dtype_keyword(SimpleNamespace(__version__="5.0.0")) == "dtype"


def test_cli_smoke(tiny_llama_dir, capsys):
    main(["peers", str(tiny_llama_dir), "--device", "cpu", "--modes", "eager", "--ctx", "4", "--tokens", "3",
          "--repeats", "1"])
    out = capsys.readouterr().out
    assert "HF transformers peers" in out and "cpu" in out


def test_unknown_mode(tiny_llama_dir):
    with pytest.raises(AtomflowError, match="unknown mode 'fast'"):
        measure_peers(tiny_llama_dir, modes=("eager", "fast"), device="cpu")


def test_no_cuda_is_a_one_line_error(tiny_llama_dir):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(GpuUnavailable, match="--device cpu"):
        measure_peers(tiny_llama_dir, device="cuda")


def test_without_torch_a_one_line_hint(tiny_llama_dir):
    code = ("import sys; sys.modules['torch'] = None; from atomflow_bench.cli import main; "
            f"main(['peers', {str(tiny_llama_dir)!r}, '--device', 'cpu'])")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and HINT in lines[0] and "pip install 'atomflow-bench[truth]'" in lines[0]
