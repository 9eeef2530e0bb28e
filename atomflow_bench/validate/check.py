"""`atomflow-bench validate`: the engine, probe by probe, against HuggingFace `transformers` in float32.

Ground truth
------------
`generate_truth` (also `scripts/gen_ground_truth.py`) loads the model directory with
`LlamaForCausalLM.from_pretrained(dtype=float32, attn_implementation="eager")` on CUDA when torch sees a
device (TF32 off: true fp32 matmuls), else on the CPU, and decodes one token per forward through its KV
cache, like the engine: the P prompt tokens, then greedy for `steps` = N new tokens, i.e. P + N - 1 forwards
(the last new token is predicted, never fed). Each forward is one *position*; forward hooks record

    embed                   output of embed_tokens
    layers.{i}.attn         residual stream after layer i's attention block (= input of post_attention_layernorm)
    layers.{i}.mlp          residual stream after layer i's MLP block (= the decoder layer's output)
    final_norm              output of the final RMSNorm
    logits                  lm_head output

for two *variants* of the same model:

    fp16   the checkpoint's fp16 weights upcast to float32 (exact); greedy -> generated_ids
    fp8    every layer projection replaced by dequantize_fp8(quantize_fp8(w)) -- the W8A16 values the engine's
           fp8 path multiplies with (quant.py is bit-exact with the GPU quantizer and `fetch --format fp8`);
           embedding, norms and lm_head as stored; teacher-forced on the fp16 variant's tokens

into `DIR/truth.safetensors` (`{variant}.pos{s}.{probe}`, float32) and `DIR/truth.json` (schema
`atomflow-bench/truth/1`: model, weights_sha256, config_sha256, prompt, prompt_ids, generated_ids, steps,
variants with their predicted ids, dtype, device, torch and transformers versions, created). weights_sha256
covers the fp16 `*.safetensors` files only -- not config.json, not the derived model-fp8.safetensors; per-file
hashes come from the store's manifest.json when it lists the file at its current size, else are computed.

Validation
----------
The engine is *teacher-forced* on HF's token stream (prompt + generated_ids), so every probe compares the same
position with the same inputs: a divergence cannot hide behind different tokens. With a usable CUDA device
the probes come from the GPU `Engine`'s real kernels: `Engine.reset(sequence)` makes the step's argmax kernel
feed the sequence's next token, and `step_eager(taps=True)` copies each launch's output buffer to the host
right after it -- the same launches the CUDA graph replays. Without one, the NumPy `ReferenceDecoder` runs
instead, and every output says so. `--weights F` is compared with the truth's variant F (like for like).

Per probe the WORST position is reported: min cosine, max relative L2 (||engine - truth|| / ||truth||) and
max |diff| (reported, not gated: it scales with the activations). A probe PASSes when min cosine >= cos_min
AND max rel L2 <= rel_max. Greedy agreement counts the N positions (last prompt token on) where the engine's
argmax equals HF's (reported, not gated: near-ties may flip). KL(HF || engine) of the last position's logits
(softmax in float64) must be <= kl_max. Exit code 0 only if every probe and the KL check pass. With fp8, the
distance of the engine from the *unquantized* fp16 variant is also printed as "quantization drift"
(not gated; --quality measures the format's cost on real text).

Thresholds and why
------------------
    format   cos_min   rel_max   kl_max (nats)
    fp16     0.999     0.05      1e-3
    fp8      0.999     0.05      1e-3

Both formats are compared with a truth made from the very weight values the engine multiplies with, so the
only legitimate differences are (a) float32 accumulation order and (b) the engine's fp16 activation buffers
(normed x, q/k/v, KV cache, attention output, SwiGLU act), each a 2^-11 relative rounding. The fp8 GEMV
decodes code x group scale exactly in float32, so it adds nothing to that budget: the same bounds apply.
Measured (worst probe over all positions, 2026-11-22):

    GPU engine, H100, synthetic llama-3.2-3b, 6 + 32 steps:  fp16 cos 0.9999914, rel 4.2e-3, KL 7.4e-6
                                                               fp8  cos 0.9999916, rel 4.1e-3, KL 8.6e-6
    NumPy reference (CPU), tiny model and SmolLM2-135M:        cos > 1 - 1e-9, rel < 1e-5, KL < 1e-10

so the bounds keep a margin of ~12x (rel), ~100x (1 - cos) and ~100x (KL) over the GPU engine. rel L2 also
catches what cosine cannot (a wrong scale: a norm weight, a dropped residual). 1 - cos ~ rel^2 / 2, so
cos 0.999 ~ rel 0.045: the two bounds are about equally tight. On the other side, the deliberately broken
engines of tests/test_validate.py (tiny model, 17 positions) fail their first probe by: k_proj x1.5 in layer 1
-> layers.1.attn cos 0.990 / rel 0.17 (10x / 3.4x past the bounds); RoPE theta 10000 -> 500000 ->
layers.0.attn cos 0.969 / rel 0.25 (31x / 5x); gate/up swapped in layer 1 -> layers.1.mlp cos 0.70 / rel 1.0;
every earlier probe stays exact.

Why fp8 is not gated against the *unquantized* model: its distance there is the format's, not the engine's,
and it is as large as real bugs. FP8-E4M3's 3 mantissa bits round each weight by up to 2^-4 (~3% RMS), a few
% of noise per projection that compounds over depth: SmolLM2-135M reaches hidden cos 0.991 / logits cos 0.966
(rel 0.26), and the random-weight synthetic 3B (chaotic at init std 0.02) hidden cos 0.935 / rel 0.36 with
greedy agreement 11/32 -- worse than the k_proj fault above. Bounds loose enough for that could not tell a
correct fp8 engine from a broken one; comparing with the fp8 variant can.

Quality (`validate --quality`)
------------------------------
fp8 against fp16 on real text (atomflow_bench/data/english_paragraph.txt): the same engine backend runs both
formats teacher-forced over the paragraph; reported: top-1 agreement fp8 vs fp16, mean KL(fp16 || fp8) per
token, and both perplexities (exp mean NLL of tokens 1..T-1). Bounds (real weights only; a synthetic model's
random weights give no meaningful quality numbers, so it is reported without a verdict):
top-1 >= 0.90, mean KL <= 0.05 nats, ppl(fp8) / ppl(fp16) <= 1.10. SmolLM2-135M, NumPy reference, 144 tokens:
ppl 15.167 (fp16) vs 15.630 (fp8, x1.031), top-1 agreement 0.951, mean KL 0.0129 nats (max 0.056).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..store import store
from ..errors import AtomflowError, ConfigError, VerifyError
from ..gpu.nvrtc import instrument_defines
from ..store.checkpoint import Checkpoint

TRUTH_SCHEMA = "atomflow-bench/truth/1"
RESULT_SCHEMA = "atomflow-bench/validate/1"
QUALITY_SCHEMA = "atomflow-bench/quality/1"
TRUTH_JSON = "truth.json"
TRUTH_TENSORS = "truth.safetensors"
FP8_FILE = "model-fp8.safetensors"  # derived from the fp16 weights: not part of the weights hash
TRUTH_HINT = "pip install 'atomflow-bench[truth]'  (or: pip install torch transformers)"
DEFAULT_PROMPT = "The capital of France is"
DEFAULT_STEPS = 32
PARAGRAPH = Path(__file__).resolve().parents[1] / "data" / "english_paragraph.txt"


class TruthUnavailable(AtomflowError):
    """torch / transformers are missing, so no ground truth can be generated here."""


@dataclass(frozen=True)
class Thresholds:
    cos_min: float   # every probe: min cosine over the positions
    rel_max: float   # every probe: max ||engine - truth|| / ||truth|| over the positions
    kl_max: float    # KL(HF || engine) of the last position's logits, nats


# Same bounds for both formats: each is compared with a truth made from its own weight values (module docstring).
THRESHOLDS = {
    "fp16": Thresholds(cos_min=0.999, rel_max=0.05, kl_max=1e-3),
    "fp8": Thresholds(cos_min=0.999, rel_max=0.05, kl_max=1e-3),
}
QUALITY_BOUNDS = {"top1_min": 0.90, "mean_kl_max": 0.05, "ppl_ratio_max": 1.10}


def probe_names(n_layers: int) -> list[str]:
    """The compared probes in decode order: embed, per layer attn then mlp, final_norm, logits."""
    return ["embed"] + [f"layers.{i}.{k}" for i in range(n_layers) for k in ("attn", "mlp")] + ["final_norm", "logits"]


# ---- identities: weights hash, prompt ------------------------------------------------------------------
def weights_sha256(model_dir: str | Path) -> str:
    """sha256 over "name sha256" lines of the model's fp16 *.safetensors files (sorted by name).

    Per-file hashes are taken from manifest.json when it lists the file at its current size (the store's
    record; `fetch --verify` re-hashes), else computed. config.json, tokenizer and model-fp8.safetensors are
    not covered (a wrong config is what validate must catch, and the fp8 file is derived from these files).
    """
    d = Path(model_dir)
    files = sorted(p for p in d.glob("*.safetensors") if p.name != FP8_FILE)
    if not files:
        raise VerifyError(f"{d}: no *.safetensors files")
    listed = {}
    if (d / store.MANIFEST).is_file():
        try:
            listed = store.read_manifest(d)["files"]
        except VerifyError:
            listed = {}
    lines = []
    for f in files:
        meta = listed.get(f.name)
        ok = isinstance(meta, dict) and meta.get("size") == f.stat().st_size and meta.get("sha256")
        lines.append(f"{f.name} {meta['sha256'] if ok else store.sha256_file(f)}\n")
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def config_sha256(model_dir: str | Path) -> str:
    return store.sha256_file(Path(model_dir) / "config.json")


def model_name(model_dir: Path) -> str:
    m = Path(model_dir) / store.MANIFEST
    if m.is_file():
        try:
            return json.loads(m.read_text()).get("model") or Path(model_dir).name
        except json.JSONDecodeError:
            pass
    return Path(model_dir).name


def model_source(model_dir: Path) -> str:
    m = Path(model_dir) / store.MANIFEST
    if m.is_file():
        try:
            return json.loads(m.read_text()).get("source", {}).get("kind", "unknown")
        except json.JSONDecodeError:
            pass
    return "local"


def choose_prompt(model_dir: Path, vocab_size: int, prompt: str | None = None) -> tuple[list[int], str | None]:
    """(prompt ids, prompt text): the model's tokenizer encodes `prompt` (default DEFAULT_PROMPT) with its
    special tokens; a model without tokenizer.json gets 8 seeded random ids (text None)."""
    from ..store.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    if tok is None:
        if prompt is not None:
            raise ConfigError(f"{model_dir}: no tokenizer.json, so --prompt cannot be encoded (omit it to use "
                              "8 seeded random token ids)")
        return [int(t) for t in np.random.default_rng(0).integers(0, vocab_size, 8)], None
    text = DEFAULT_PROMPT if prompt is None else prompt
    ids = [int(t) for t in tok.encode(text).ids]
    if not ids:
        raise ConfigError(f"the prompt {text!r} encodes to no tokens")
    return ids, text


# ---- ground truth (HF transformers, float32) -------------------------------------------------------------
def require_truth_deps():
    """(torch, transformers), or TruthUnavailable with the one-line install hint."""
    try:
        import torch
        import transformers
    except ImportError as e:
        raise TruthUnavailable(f"ground truth needs torch and transformers ({e.name or 'torch'} is missing): "
                               f"{TRUTH_HINT}") from None
    return torch, transformers


def _load_hf(model_dir: Path, device: str):
    import warnings

    torch, transformers = require_truth_deps()
    from transformers import LlamaForCausalLM

    with warnings.catch_warnings():  # true fp32 matmuls on CUDA: no TF32 (some torch versions warn here)
        warnings.simplefilter("ignore")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
    transformers.utils.logging.disable_progress_bar()
    major = int(transformers.__version__.split(".")[0])
    dtype_kw = "dtype" if major >= 5 else "torch_dtype"
    model = LlamaForCausalLM.from_pretrained(str(model_dir), **{dtype_kw: torch.float32},
                                             attn_implementation="eager")
    return model.to(device=device, dtype=torch.float32).eval()


_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _to_fp8_values(model, ckpt: Checkpoint) -> None:
    """Replace every layer projection of the HF model by dequantize_fp8(quantize_fp8(w)): exactly the weight values
    the engine's fp8 (W8A16) path multiplies with (quant.py is bit-exact with the GPU quantizer and fetch's file)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from ..quant import dequantize_fp8, quantize_fp8

    jobs = [(i, p) for i in range(ckpt.config.num_hidden_layers) for p in _PROJECTIONS]

    def work(job):
        i, p = job
        return job, dequantize_fp8(*quantize_fp8(ckpt.get(f"model.layers.{i}.{p}.weight")))

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool, torch.no_grad():
        for (i, p), w in pool.map(work, jobs):
            mod = model.model.layers[i].get_submodule(p)
            mod.weight.copy_(torch.from_numpy(w).to(mod.weight.device))


def _hf_run(model, prompt_ids: list[int], steps: int, device: str, forced: list[int] | None = None):
    """HF one token per forward through its KV cache, P + steps - 1 forwards.

    forced=None: greedy (the prompt, then HF's own argmax); forced=seq: teacher-forced on seq.
    Returns (argmax of each position from P-1 on, per-position probe dicts).
    """
    import torch

    m = model.model
    cur: dict[str, np.ndarray] = {}
    handles = []

    def put(name, t):
        t = t[0] if isinstance(t, (tuple, list)) else t
        cur[name] = t.detach().to(torch.float32).reshape(-1).cpu().numpy().copy()

    handles.append(m.embed_tokens.register_forward_hook(lambda mod, a, out: put("embed", out)))
    for i, layer in enumerate(m.layers):
        # the input of post_attention_layernorm is the residual stream right after the attention block
        handles.append(layer.post_attention_layernorm.register_forward_pre_hook(
            lambda mod, a, n=f"layers.{i}.attn": put(n, a[0])))
        handles.append(layer.register_forward_hook(lambda mod, a, out, n=f"layers.{i}.mlp": put(n, out)))
    handles.append(m.norm.register_forward_hook(lambda mod, a, out: put("final_norm", out)))

    P = len(prompt_ids)
    seq = list(forced) if forced is not None else list(prompt_ids)
    predicted: list[int] = []
    positions: list[dict[str, np.ndarray]] = []
    past = None
    names = probe_names(model.config.num_hidden_layers)
    try:
        with torch.inference_mode():
            for s in range(P + steps - 1):
                cur.clear()
                out = model(input_ids=torch.tensor([[seq[s]]], device=device), past_key_values=past, use_cache=True)
                past = out.past_key_values
                cur["logits"] = out.logits[0, -1].to(torch.float32).cpu().numpy().copy()
                missing = [n for n in names if n not in cur]
                if missing:
                    import transformers

                    raise AtomflowError(f"transformers {transformers.__version__}: the hooks did not capture "
                                        f"{missing[0]!r}")
                positions.append({n: cur[n] for n in names})
                if s >= P - 1:
                    nxt = int(np.argmax(cur["logits"]))
                    predicted.append(nxt)
                    if forced is None:
                        seq.append(nxt)
    finally:
        for h in handles:
            h.remove()
    return predicted, positions


VARIANT_WEIGHTS = {
    "fp16": "the checkpoint's fp16 weights, upcast to float32 (exact)",
    "fp8": "layer projections replaced by dequantize_fp8(quantize_fp8(w)) (atomflow_bench.quant, the engine's W8A16 "
           "values); embedding, norms, lm_head as stored; teacher-forced on the fp16 variant's tokens",
}


def generate_truth(model_dir: str | Path, out_dir: str | Path, prompt: str | None = None, steps: int = DEFAULT_STEPS,
                   prompt_ids: list[int] | None = None, device: str | None = None, formats=("fp16", "fp8"),
                   console=None) -> dict:
    """Run HF transformers (fp32, eager) on `model_dir` and write DIR/truth.safetensors + DIR/truth.json.

    Variant fp16 (always): greedy from the prompt. Variant fp8 (if in `formats`): the same model with the fp8
    weight values, teacher-forced on fp16's tokens. Returns the manifest. `device`: cuda | cpu | None (cuda when
    torch sees a device).
    """
    torch, transformers = require_truth_deps()
    from safetensors.numpy import save_file

    from ..measure.run_record import now_iso, tool_info

    if steps < 1:
        raise ConfigError(f"steps must be at least 1, got {steps}")
    bad = [f for f in formats if f not in VARIANT_WEIGHTS]
    if bad:
        raise ConfigError(f"unknown weight format {bad[0]!r} (expected fp16 or fp8)")
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    ckpt = Checkpoint(model_dir)
    cfg = ckpt.config
    if prompt_ids is None:
        prompt_ids, prompt = choose_prompt(model_dir, cfg.vocab_size, prompt)
    prompt_ids = [int(t) for t in prompt_ids]
    if not prompt_ids or min(prompt_ids) < 0 or max(prompt_ids) >= cfg.vocab_size:
        raise ConfigError(f"prompt ids must be non-empty and lie in [0, {cfg.vocab_size})")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise AtomflowError("--device cuda: torch sees no CUDA device")
    dev_name = torch.cuda.get_device_name(0) if device == "cuda" else (platform.processor() or platform.machine())
    variants = ["fp16"] + (["fp8"] if "fp8" in formats else [])
    if console is not None:
        console.print(f"ground truth: transformers {transformers.__version__} (torch {torch.__version__}, fp32, "
                      f"eager) on {device} ({dev_name}): {len(prompt_ids)} prompt tokens + {steps} steps, "
                      f"weights {' and '.join(variants)}")
    whash = weights_sha256(model_dir)
    model = _load_hf(model_dir, device)
    new, runs = _hf_run(model, prompt_ids, steps, device)
    runs = {"fp16": runs}
    predicted = {"fp16": new}
    if "fp8" in variants:
        _to_fp8_values(model, ckpt)
        predicted["fp8"], runs["fp8"] = _hf_run(model, prompt_ids, steps, device, forced=prompt_ids + new)
    del model
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()  # give the GPU memory back before the engine plans its arena

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {f"{v}.pos{s}.{n}": np.ascontiguousarray(t, dtype=np.float32)
               for v, positions in runs.items() for s, probes in enumerate(positions) for n, t in probes.items()}
    fd, tmp = tempfile.mkstemp(prefix=TRUTH_TENSORS + ".", suffix=".tmp", dir=out_dir)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"schema": TRUTH_SCHEMA})
        os.replace(tmp, out_dir / TRUTH_TENSORS)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    manifest = {
        "schema": TRUTH_SCHEMA,
        "model": model_name(model_dir),
        "model_dir": str(model_dir.resolve()),
        "weights_sha256": whash,
        "config_sha256": config_sha256(model_dir),
        "prompt": prompt,
        "prompt_ids": prompt_ids,
        "generated_ids": new,
        "steps": steps,
        "positions": len(runs["fp16"]),
        "num_hidden_layers": cfg.num_hidden_layers,
        "probes": probe_names(cfg.num_hidden_layers),
        "variants": {v: {"weights": VARIANT_WEIGHTS[v], "predicted_ids": predicted[v]} for v in variants},
        "tensors": "{variant}.pos{s}.{probe} float32; position s feeds (prompt_ids + generated_ids)[s]",
        "dtype": "float32",
        "attn_implementation": "eager",
        "device": f"{device} ({dev_name})",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "created": now_iso(),
        "tool": tool_info(),
    }
    store.write_json_atomic(out_dir / TRUTH_JSON, manifest)  # written last: its presence means complete
    return manifest


class Truth:
    """A ground-truth directory: `manifest` (truth.json) and `get(variant, position, probe)` (float32)."""

    def __init__(self, directory: str | Path):
        from safetensors import safe_open

        self.dir = Path(directory)
        path = self.dir / TRUTH_JSON
        try:
            self.manifest = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{self.dir}: no {TRUTH_JSON} (generate it with scripts/gen_ground_truth.py)") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e.msg})") from None
        if not isinstance(self.manifest, dict) or self.manifest.get("schema") != TRUTH_SCHEMA:
            raise ConfigError(f"{path}: not an {TRUTH_SCHEMA} manifest")
        if not (self.dir / TRUTH_TENSORS).is_file():
            raise ConfigError(f"{self.dir}: {TRUTH_TENSORS} is missing")
        self._st = safe_open(str(self.dir / TRUTH_TENSORS), framework="numpy")

    @property
    def sequence(self) -> list[int]:
        return list(self.manifest["prompt_ids"]) + list(self.manifest["generated_ids"])

    @property
    def variants(self) -> list[str]:
        return list(self.manifest["variants"])

    def predicted(self, variant: str) -> list[int]:
        return list(self.manifest["variants"][variant]["predicted_ids"])

    def get(self, variant: str, pos: int, probe: str) -> np.ndarray:
        return self._st.get_tensor(f"{variant}.pos{pos}.{probe}")


def default_truth_dir(model_dir: Path, whash: str, prompt_ids: list[int], steps: int) -> Path:
    """Cache location: <ATOMFLOW_HOME>/truth/<model>-<weights hash>-p<prompt hash>-s<steps>."""
    import re

    phash = hashlib.sha256(json.dumps(prompt_ids).encode()).hexdigest()[:10]
    name = re.sub(r"[^A-Za-z0-9._]+", "-", model_name(model_dir)).strip("-") or "model"
    return store.home() / "truth" / f"{name[-48:]}-{whash[:12]}-p{phash}-s{steps}"


# ---- the engine side -----------------------------------------------------------------------------------
def _pick_backend(backend: str) -> tuple[str, str]:
    """('gpu' | 'numpy', label)."""
    from ..gpu.device import require_gpu
    from ..errors import GpuUnavailable

    if backend not in ("auto", "gpu", "numpy"):
        raise ConfigError(f"unknown backend {backend!r} (expected auto, gpu or numpy)")
    if backend == "numpy":
        return "numpy", "NumPy reference (CPU), as requested — not the GPU engine"
    try:
        require_gpu()
    except GpuUnavailable:
        if backend == "gpu":
            raise
        return "numpy", "NumPy reference (CPU) — no GPU"
    return "gpu", "GPU engine (CuPy kernels; probes copied after each launch of the eager step)"


def _backend_info(kind: str) -> dict:
    if kind == "gpu":
        from ..gpu.device import gpu_info

        return {"gpu": gpu_info()}
    return {"cpu": platform.processor() or platform.machine(), "numpy": np.__version__}


def engine_probes(model_dir: str | Path, weights: str, sequence: list[int], n_positions: int, names: list[str],
                  backend: str = "auto", forms=None, group=None,
                  allreduce: str | None = None) -> tuple[dict, list[dict[str, np.ndarray]]]:
    """Teacher-force `sequence` through the engine for `n_positions` positions; per position the probes `names`.

    GPU: `Engine.reset(sequence)` then `step_eager(taps=True)` per position: the real kernels' buffers.
    No GPU (or backend="numpy"): `ReferenceDecoder(record_taps=True)`, labelled as such.
    Tensor parallel (`group`, GPU only): every rank runs this; the probes compared are the replicated ones (the
    residual stream after each sum across ranks, the final norm) and the logits, gathered from the vocabulary shards.
    Returns ({"kind", "label", ...info}, [probes per position]).
    """
    kind, label = _pick_backend("gpu" if group is not None else backend)
    info = {"kind": kind, "label": label, **_backend_info(kind)}
    out: list[dict[str, np.ndarray]] = []
    if kind == "gpu":
        from ..gpu.engine import Engine
        from ..measure.tune import resolve

        eng = Engine(model_dir, weights=weights, max_seq=len(sequence), group=group, allreduce=allreduce)
        if group is None:
            info["forms"] = resolve(eng, forms, tune_missing=False)  # given, saved or the defaults: never timed here
        else:
            from ..gpu.tp.figures import tp_forms

            info["forms"] = tp_forms(eng, forms)
            info["tp"] = {"n": group.size, "allreduce": eng.tp.path, "peer_reason": eng.tp.peer_reason}
            info["label"] += f", tensor parallel over {group.size} GPUs (sums: {eng.tp.path})"
        eng.reset(sequence)
        for _ in range(n_positions):
            taps = eng.step_eager(taps=True)
            if group is not None:  # the logits of every rank's vocabulary rows, in rank order
                taps["logits"] = eng.tp.gather_vocab(taps["logits"], eng.cfg.vocab_size)
            out.append({n: np.asarray(taps[n], np.float32).reshape(-1) for n in names})
        info["fp8_source"] = eng.load_info.get("fp8_source")
        del eng
        _free_gpu()
    else:
        from ..reference import ReferenceDecoder

        ckpt = Checkpoint(model_dir)
        lazy = ckpt.config.param_count() * 4 > (4 << 30)  # float32 copy over 4 GiB: upcast block by block
        dec = ReferenceDecoder(ckpt, weights=weights, max_seq=len(sequence), record_taps=True, lazy=lazy)
        for s in range(n_positions):
            dec.step(int(sequence[s]))
            out.append({n: dec.taps[n] for n in names})
    return info, out


def _free_gpu() -> None:
    try:
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()
    except Exception:  # noqa: BLE001 - best effort
        pass


# ---- metrics -------------------------------------------------------------------------------------------
def metrics(engine: np.ndarray, truth: np.ndarray) -> tuple[float, float, float]:
    """(cosine, relative L2 = ||e - t|| / ||t||, max |e - t|) in float64."""
    e = np.asarray(engine, np.float64).ravel()
    t = np.asarray(truth, np.float64).ravel()
    if e.shape != t.shape:
        raise VerifyError(f"probe sizes differ: engine {e.size}, truth {t.size}")
    ne, nt = np.linalg.norm(e), np.linalg.norm(t)
    d = e - t
    cos = float(e @ t / (ne * nt)) if ne > 0 and nt > 0 else (1.0 if ne == nt else 0.0)
    rel = float(np.linalg.norm(d) / nt) if nt > 0 else (0.0 if not d.any() else math.inf)
    if not np.isfinite(e).all():
        cos, rel = -1.0, math.inf
    return cos, rel, float(np.abs(d).max()) if d.size else 0.0


def log_softmax64(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, np.float64)
    z = z - z.max()
    return z - math.log(np.exp(z).sum())


def kl_div(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """KL(softmax(p) || softmax(q)) in nats, float64."""
    lp, lq = log_softmax64(p_logits), log_softmax64(q_logits)
    return float(np.sum(np.exp(lp) * (lp - lq)))


# ---- validate ------------------------------------------------------------------------------------------
def _truth_for(model_dir: Path, cfg, whash: str, truth_dir, steps, prompt, console) -> Truth:
    """Reuse the truth in `truth_dir` (or the cache), else generate it there (needs torch)."""
    if truth_dir is not None and (Path(truth_dir) / TRUTH_JSON).is_file():
        t = Truth(truth_dir)
        m = t.manifest
        if steps is not None and steps != m["steps"]:
            raise ConfigError(f"{truth_dir}: the ground truth has {m['steps']} steps, --steps asks {steps} "
                              "(omit --steps, or point --truth at a new directory)")
        if prompt is not None and prompt != m.get("prompt"):
            raise ConfigError(f"{truth_dir}: the ground truth was made for prompt {m.get('prompt')!r}, not {prompt!r}")
        if console is not None:
            console.print(f"ground truth: {truth_dir} (transformers {m['transformers']}, torch {m['torch']}, "
                          f"{m['device']})")
        return t
    steps = DEFAULT_STEPS if steps is None else steps
    prompt_ids, text = choose_prompt(model_dir, cfg.vocab_size, prompt)
    if truth_dir is None:
        truth_dir = default_truth_dir(model_dir, whash, prompt_ids, steps)
        if (truth_dir / TRUTH_JSON).is_file():
            if console is not None:
                console.print(f"ground truth: reusing {truth_dir}")
            return Truth(truth_dir)
    try:
        require_truth_deps()
    except TruthUnavailable as e:
        raise TruthUnavailable(f"no ground truth given and none can be made here: {e}; or make it on another "
                               "machine with `python scripts/gen_ground_truth.py MODEL --out DIR` and pass "
                               "--truth DIR") from None
    generate_truth(model_dir, truth_dir, prompt=text, steps=steps, prompt_ids=prompt_ids, console=console)
    if console is not None:
        console.print(f"ground truth written to {truth_dir}")
    return Truth(truth_dir)


def _compare(positions: list[dict], truth: Truth, variant: str, names: list[str]) -> tuple[dict, list[float]]:
    """Per probe the worst position ({cos, rel_l2, max_abs, worst_pos}); and KL(truth || engine) per position."""
    worst = {n: {"cos": 1.0, "rel_l2": 0.0, "max_abs": 0.0, "worst_pos": 0} for n in names}
    key = {n: (2.0, 0.0) for n in names}  # (cos, -rel) of the worst position so far
    kls = []
    for s, probes in enumerate(positions):
        for n in names:
            c, r, a = metrics(probes[n], truth.get(variant, s, n))
            w = worst[n]
            if (c, -r) < key[n]:
                key[n], w["worst_pos"] = (c, -r), s
            w["cos"], w["rel_l2"], w["max_abs"] = min(w["cos"], c), max(w["rel_l2"], r), max(w["max_abs"], a)
        kls.append(kl_div(truth.get(variant, s, "logits"), probes["logits"]))
    return worst, kls


def prepare_truth(model_dir: str | Path, truth_dir=None, steps: int | None = None, prompt: str | None = None,
                  console=None) -> Path:
    """The ground truth `validate` will use, made now if missing (a tensor-parallel launch makes it once, before its
    ranks start)."""
    model_dir = Path(model_dir)
    cfg = Checkpoint(model_dir).config
    return _truth_for(model_dir, cfg, weights_sha256(model_dir), truth_dir, steps, prompt, console).dir


def validate(model_dir: str | Path, weights: str = "fp8", truth_dir: str | Path | None = None,
             steps: int | None = None, prompt: str | None = None, backend: str = "auto",
             allow_mismatch: bool = False, console=None, forms=None, group=None, allreduce: str | None = None) -> dict:
    """Compare the engine's probes with the ground truth; returns the result record (schema validate/1). `forms`:
    the launch forms to check (gpu/forms.py; default: a saved tune, else the defaults). `group`: tensor parallel
    (engine_probes)."""
    from ..measure.run_record import now_iso, tool_info

    if weights not in THRESHOLDS:
        raise ConfigError(f"unknown weight format {weights!r} (expected fp16 or fp8)")
    inst = instrument_defines()
    if inst:
        raise ConfigError(f"ATOMFLOW_KERNEL_DEFINES sets the timing instrument {' '.join(inst)}, which makes the "
                          "kernels wrong on purpose; unset it to validate")
    model_dir = Path(model_dir)
    ckpt = Checkpoint(model_dir)
    cfg = ckpt.config
    whash = weights_sha256(model_dir)
    truth = _truth_for(model_dir, cfg, whash, truth_dir, steps, prompt, console)
    m = truth.manifest
    notes = []
    if m["weights_sha256"] != whash:
        msg = (f"the ground truth in {truth.dir} was made from other weights (sha256 {m['weights_sha256'][:12]}…, "
               f"this model {whash[:12]}…)")
        if not allow_mismatch:
            raise VerifyError(msg + "; regenerate it for this model, or pass --allow-mismatch to compare anyway")
        notes.append(msg + " — compared anyway (--allow-mismatch)")
    if m.get("config_sha256") and m["config_sha256"] != config_sha256(model_dir):
        notes.append("config.json differs from the one the ground truth was made with")
    if m["num_hidden_layers"] != cfg.num_hidden_layers:
        raise VerifyError(f"the ground truth has {m['num_hidden_layers']} layers, the model {cfg.num_hidden_layers}")
    if weights not in truth.variants:
        raise ConfigError(f"{truth.dir}: the ground truth has no {weights} variant (it has "
                          f"{', '.join(truth.variants)}); make it with --formats fp16,fp8")
    if console is not None:
        for n in notes:
            console.print(f"[yellow]note: {n}[/yellow]")

    names = probe_names(cfg.num_hidden_layers)
    seq, P, N = truth.sequence, len(m["prompt_ids"]), int(m["steps"])
    n_pos = P + N - 1
    info, positions = engine_probes(model_dir, weights, seq, n_pos, names, backend, forms, group, allreduce)
    if console is not None:
        console.print(f"engine: {info['label']}")
    th = THRESHOLDS[weights]

    worst, kls = _compare(positions, truth, weights, names)
    own = [int(np.argmax(positions[s]["logits"])) for s in range(P - 1, n_pos)]
    agree = sum(a == b for a, b in zip(own, truth.predicted(weights)))
    probes = []
    for n in names:
        w = worst[n]
        ok = w["cos"] >= th.cos_min and w["rel_l2"] <= th.rel_max
        probes.append({"name": n, **w, "pass": bool(ok)})
    n_pass = sum(p["pass"] for p in probes)
    kl_ok = kls[-1] <= th.kl_max
    first_fail = next((p["name"] for p in probes if not p["pass"]), None)

    drift = None
    if weights != "fp16" and "fp16" in truth.variants:
        # not gated: how far the quantized model itself is from the unquantized one (see also --quality)
        dw, dkl = _compare(positions, truth, "fp16", names)
        hidden = min((dw[n] for n in names[:-1]), key=lambda w: w["cos"])
        drift = {"against": "fp16 variant (unquantized weights)",
                 "hidden_min_cos": hidden["cos"], "hidden_max_rel_l2": max(dw[n]["rel_l2"] for n in names[:-1]),
                 "logits_min_cos": dw["logits"]["cos"], "logits_max_rel_l2": dw["logits"]["rel_l2"],
                 "kl_last": dkl[-1], "kl_mean": float(np.mean(dkl)), "kl_max": max(dkl),
                 "greedy_agree": sum(a == b for a, b in zip(own, seq[P:])), "greedy_total": N,
                 "probes": {n: dw[n] for n in names}}
    return {
        "schema": RESULT_SCHEMA,
        "created": now_iso(),
        "tool": tool_info(),
        "model": {"name": model_name(model_dir), "dir": str(model_dir), "source": model_source(model_dir),
                  "weights_sha256": whash, "layers": cfg.num_hidden_layers, "params": cfg.param_count()},
        "weights": weights,
        "backend": info,
        "truth": {"dir": str(truth.dir), "variant": weights, "variant_weights": m["variants"][weights]["weights"],
                  **{k: m.get(k) for k in ("weights_sha256", "prompt", "prompt_ids", "generated_ids", "steps",
                                           "positions", "device", "torch", "transformers", "created")}},
        "notes": notes,
        "thresholds": {"format": weights, **asdict(th), "rule": "a probe PASSes when its min cosine >= cos_min and "
                       "its max rel L2 <= rel_max over all positions; KL(HF || engine) of the last position's "
                       "logits <= kl_max; exit 0 only if all pass"},
        "probes": probes,
        "summary": {
            "probes_pass": n_pass, "probes_total": len(probes), "first_fail": first_fail,
            "greedy_agree": agree, "greedy_total": N, "engine_ids": own,
            "kl_last": kls[-1], "kl_max_over_positions": max(kls), "kl_pass": bool(kl_ok),
            "min_cos": min(p["cos"] for p in probes), "max_rel_l2": max(p["rel_l2"] for p in probes),
            "pass": bool(n_pass == len(probes) and kl_ok),
        },
        "drift": drift,
    }


def print_result(res: dict, console, fmt: str | None = None) -> None:
    """The per-probe table (output.render in `fmt`) and the summary lines (on stderr with --format csv/json)."""
    from rich.markup import escape

    from ..output import Tab, notes_console, render

    th = res["thresholds"]
    cols = ["probe", "cos (min)", "rel L2", "max|diff|", "pos", "threshold", "result"]
    t = Tab(f"validate — {res['model']['name']} {res['weights']} vs transformers fp32 ({res['weights']} weight values)",
            cols, caption=f"engine: {res['backend']['label']}; worst position per probe", key="probes",
            right=("cos (min)", "rel L2", "max|diff|", "pos"))
    thr = f"≥{th['cos_min']:g}/≤{th['rel_max']:g}"
    for p in res["probes"]:
        t.add(p["name"], f"{p['cos']:.7f}", f"{p['rel_l2']:.2e}", f"{p['max_abs']:.2e}", str(p["worst_pos"]),
              thr, "PASS" if p["pass"] else "FAIL", cell_styles={"result": "green" if p["pass"] else "red bold"})
    render(t, fmt, console)
    console = notes_console(fmt, console)
    s = res["summary"]
    tr = res["truth"]
    col = "green" if s["probes_pass"] == s["probes_total"] else "red"
    console.print(f"[{col}]{s['probes_pass']}/{s['probes_total']} probes PASS[/{col}]"
                  + (f"  (first FAIL: {s['first_fail']})" if s["first_fail"] else ""), soft_wrap=True)
    console.print(f"greedy agreement: {s['greedy_agree']}/{s['greedy_total']} steps (engine argmax = HF argmax; "
                  f"prompt {len(tr['prompt_ids'])} tokens, {tr['positions']} positions teacher-forced)", soft_wrap=True)
    console.print(f"KL(HF || engine), last logits: {s['kl_last']:.3e} nats (≤ {th['kl_max']:g}) "
                  + ("[green]PASS[/green]" if s["kl_pass"] else "[red]FAIL[/red]")
                  + f"; max over positions {s['kl_max_over_positions']:.3e}", soft_wrap=True)
    d = res.get("drift")
    if d:
        console.print(f"fp8 quantization drift vs the unquantized model (not gated; see --quality): hidden min cos "
                      f"{d['hidden_min_cos']:.4f} (rel L2 ≤ {d['hidden_max_rel_l2']:.3f}), logits min cos "
                      f"{d['logits_min_cos']:.4f}, KL last {d['kl_last']:.2e} / mean {d['kl_mean']:.2e} nats, "
                      f"greedy = HF fp16 tokens {d['greedy_agree']}/{d['greedy_total']}", soft_wrap=True)
    for n in res.get("notes", []):
        console.print(f"[yellow]note: {escape(n)}[/yellow]", soft_wrap=True)
    console.print(("[green bold]PASS[/green bold]" if s["pass"] else "[red bold]FAIL[/red bold]")
                  + f" — {res['weights']} on {escape(res['backend']['label'])}", soft_wrap=True)


# ---- quality: fp8 vs fp16 on real text -----------------------------------------------------------------
def _teacher_forced_logits(model_dir: Path, weights: str, ids: list[int], kind: str) -> np.ndarray:
    """float32 logits [len(ids) - 1, vocab] of positions 0..T-2 (each predicting ids[s + 1])."""
    n = len(ids) - 1
    if kind == "gpu":
        from ..gpu.engine import Engine

        eng = Engine(model_dir, weights=weights, max_seq=len(ids))
        eng.reset(ids)
        out = np.empty((n, eng.cfg.vocab_size), np.float32)
        for s in range(n):
            eng.step_eager()
            eng.stream.synchronize()
            out[s] = eng.arena["logits"].get()
        del eng
        _free_gpu()
        return out
    from ..reference import ReferenceDecoder

    ckpt = Checkpoint(model_dir)
    lazy = ckpt.config.param_count() * 4 > (4 << 30)
    dec = ReferenceDecoder(ckpt, weights=weights, max_seq=len(ids), lazy=lazy)
    return np.stack([dec.step(int(t)) for t in ids[:-1]])


def quality(model_dir: str | Path, backend: str = "auto", text: str | None = None, console=None) -> dict:
    """fp8 vs fp16 of the same backend, teacher-forced over `text` (default: the shipped English paragraph)."""
    from ..measure.run_record import now_iso, tool_info
    from ..store.tokenizer import load_tokenizer

    model_dir = Path(model_dir)
    Checkpoint(model_dir)  # a loadable model before anything runs
    tok = load_tokenizer(model_dir)
    if tok is None:
        raise ConfigError(f"{model_dir}: --quality needs the model's tokenizer (tokenizer.json)")
    text = PARAGRAPH.read_text().strip() if text is None else text
    ids = [int(t) for t in tok.encode(text).ids]
    if len(ids) < 2:
        raise ConfigError("--quality needs a text of at least two tokens")
    kind, label = _pick_backend(backend)
    if console is not None:
        console.print(f"quality: {len(ids)} tokens of English text, fp16 and fp8 on {label}")
    lg = {fmt: _teacher_forced_logits(model_dir, fmt, ids, kind) for fmt in ("fp16", "fp8")}
    nxt = np.asarray(ids[1:])
    res: dict = {}
    logp = {}
    for fmt, z in lg.items():
        lp = np.stack([log_softmax64(row) for row in z])
        logp[fmt] = lp
        nll = -lp[np.arange(len(nxt)), nxt]
        res[fmt] = {"perplexity": float(math.exp(nll.mean())),
                    "top1_next_token": float(np.mean(np.argmax(z, axis=1) == nxt))}
    kl = np.sum(np.exp(logp["fp16"]) * (logp["fp16"] - logp["fp8"]), axis=1)
    top1 = float(np.mean(np.argmax(lg["fp8"], axis=1) == np.argmax(lg["fp16"], axis=1)))
    ratio = res["fp8"]["perplexity"] / res["fp16"]["perplexity"]
    synthetic = model_source(model_dir) == "synthetic"
    b = QUALITY_BOUNDS
    checks = {"top1_agreement": top1 >= b["top1_min"], "mean_kl": float(kl.mean()) <= b["mean_kl_max"],
              "ppl_ratio": ratio <= b["ppl_ratio_max"]}
    return {
        "schema": QUALITY_SCHEMA,
        "created": now_iso(),
        "tool": tool_info(),
        "model": {"name": model_name(model_dir), "dir": str(model_dir), "source": model_source(model_dir),
                  "weights_sha256": weights_sha256(model_dir)},
        "backend": {"kind": kind, "label": label, **_backend_info(kind)},
        "text": {"tokens": len(ids), "predictions": len(nxt), "sha256": hashlib.sha256(text.encode()).hexdigest()},
        "fp16": res["fp16"], "fp8": res["fp8"],
        "top1_agreement": top1,
        "mean_kl_fp16_fp8": float(kl.mean()), "max_kl_fp16_fp8": float(kl.max()),
        "ppl_ratio": ratio,
        "bounds": b,
        "checks": checks,
        "pass": None if synthetic else bool(all(checks.values())),
        "note": "synthetic random weights: quality numbers carry no meaning; no verdict" if synthetic else None,
    }


def print_quality(q: dict, console, fmt: str | None = None) -> None:
    """The fp8-vs-fp16 table (output.render in `fmt`) and the verdict line (on stderr with --format csv/json)."""
    from rich.markup import escape

    from ..output import Tab, notes_console, render

    cols = ["metric", "fp16", "fp8", "bound", "result"]
    t = Tab(f"quality — {q['model']['name']}: fp8 vs fp16 over {q['text']['tokens']} tokens ({q['backend']['label']})",
            cols, key="quality", right=("fp16", "fp8"))
    b, c = q["bounds"], q["checks"]

    def row(metric, fp16, fp8, bound, check=None):
        verdict = "" if check is None else "—" if q["pass"] is None else "PASS" if c[check] else "FAIL"
        t.add(metric, fp16, fp8, bound, verdict, cell_styles={"result": {"PASS": "green", "FAIL": "red"}.get(verdict)})

    row("perplexity", f"{q['fp16']['perplexity']:.4f}", f"{q['fp8']['perplexity']:.4f}",
        f"fp8/fp16 ≤ {b['ppl_ratio_max']:g} (is {q['ppl_ratio']:.4f})", "ppl_ratio")
    row("top-1 = next token", f"{q['fp16']['top1_next_token']:.3f}", f"{q['fp8']['top1_next_token']:.3f}", "")
    row("top-1 agreement fp8 vs fp16", "", f"{q['top1_agreement']:.4f}", f"≥ {b['top1_min']:g}", "top1_agreement")
    row("mean KL(fp16 || fp8) / token", "", f"{q['mean_kl_fp16_fp8']:.3e}", f"≤ {b['mean_kl_max']:g} nats", "mean_kl")
    row("max KL(fp16 || fp8)", "", f"{q['max_kl_fp16_fp8']:.3e}", "")
    render(t, fmt, console)
    console = notes_console(fmt, console)
    if q["note"]:
        console.print(f"[yellow]{escape(q['note'])}[/yellow]", soft_wrap=True)
    else:
        console.print("[green bold]PASS[/green bold]" if q["pass"] else "[red bold]FAIL[/red bold]")
