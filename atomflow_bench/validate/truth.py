"""The ground truth: HuggingFace transformers in float32, run once per model and prompt and stored on disk.

`generate_truth` runs `LlamaForCausalLM` (fp32, eager attention, TF32 off) one token per forward through its KV
cache, records every probe with forward hooks and writes DIR/truth.safetensors + DIR/truth.json; `Truth` reads them
back; `find_or_make_truth` reuses a stored truth or makes one. torch and transformers are an optional extra
(`pip install 'atomflow-bench[truth]'`): `require_truth_deps` is the one place that imports them.
"""
from __future__ import annotations

import gc
import hashlib
import json
import os
import platform
import re
import sys
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from .. import schemas
from ..errors import AtomflowError, ConfigError, VerifyError
from ..hf import cache_keyword, dtype_keyword, quiet
from ..measure.run_record import now_iso, tool_info
from ..quant import dequantize_fp8, quantize_fp8
from ..store import store
from ..store.checkpoint import Checkpoint
from ..store.tokenizer import load_tokenizer
from .probes import probe_names

TRUTH_SCHEMA = schemas.current("truth")
TRUTH_JSON = "truth.json"
TRUTH_TENSORS = "truth.safetensors"
FP8_FILE = "model-fp8.safetensors"  # derived from the fp16 weights: not part of the weights hash
TRUTH_HINT = "pip install 'atomflow-bench[truth]'  (or: pip install torch transformers)"
DEFAULT_PROMPT = "The capital of France is"
DEFAULT_STEPS = 32
VARIANT_WEIGHTS = {
    "fp16": "the checkpoint's fp16 weights, upcast to float32 (exact)",
    "fp8": "layer projections replaced by dequantize_fp8(quantize_fp8(w)) (atomflow_bench.quant, the engine's W8A16 "
           "values); embedding, norms, lm_head as stored; teacher-forced on the fp16 variant's tokens",
}
_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


class TruthUnavailable(AtomflowError):
    """torch / transformers are missing, so no ground truth can be generated here."""


# ---- identities: the weights, the config, the model, the prompt -----------------------------------------------
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


def _store_manifest(model_dir: Path) -> dict | None:
    """The store's manifest.json of the model, or None (a directory the store did not make, or unreadable)."""
    m = Path(model_dir) / store.MANIFEST
    if not m.is_file():
        return None
    try:
        return json.loads(m.read_text())
    except json.JSONDecodeError:
        return None


def model_name(model_dir: Path) -> str:
    """The store's name of the model, else the directory's name."""
    m = _store_manifest(model_dir)
    return (m or {}).get("model") or Path(model_dir).name


def model_source(model_dir: Path) -> str:
    """Where the store got the model (its source kind, e.g. synthetic), or "local" for a directory it did not make."""
    m = _store_manifest(model_dir)
    return "local" if m is None else m.get("source", {}).get("kind", "unknown")


def choose_prompt(model_dir: Path, vocab_size: int, prompt: str | None = None) -> tuple[list[int], str | None]:
    """(prompt ids, prompt text): the model's tokenizer encodes `prompt` (default DEFAULT_PROMPT) with its
    special tokens; a model without tokenizer.json gets 8 seeded random ids (text None)."""
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


# ---- HF transformers, float32 -----------------------------------------------------------------------------------
def require_truth_deps():
    """(torch, transformers), or TruthUnavailable with the one-line install hint."""
    try:
        import torch  # the optional [truth] extra
        import transformers
    except ImportError as e:
        raise TruthUnavailable(f"ground truth needs torch and transformers ({e.name or 'torch'} is missing): "
                               f"{TRUTH_HINT}") from None
    return torch, transformers


def _load_hf(model_dir: Path, device: str):
    torch, transformers = require_truth_deps()
    with warnings.catch_warnings():  # true fp32 matmuls on CUDA: no TF32 (some torch versions warn here)
        warnings.simplefilter("ignore")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
    transformers.utils.logging.disable_progress_bar()
    dtype = {dtype_keyword(transformers): torch.float32}
    model = transformers.LlamaForCausalLM.from_pretrained(str(model_dir), **dtype, attn_implementation="eager")
    return model.to(device=device, dtype=torch.float32).eval()


def _to_fp8_values(model, ckpt: Checkpoint) -> None:
    """Replace every layer projection of the HF model by dequantize_fp8(quantize_fp8(w)): exactly the weight values
    the engine's fp8 (W8A16) path multiplies with (quant.py is bit-exact with the GPU quantizer and fetch's file)."""
    torch, _ = require_truth_deps()
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
    torch, transformers = require_truth_deps()
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
    past, kw = None, cache_keyword(model)
    names = probe_names(model.config.num_hidden_layers)
    try:
        with torch.inference_mode():
            for s in range(P + steps - 1):
                cur.clear()
                out = model(input_ids=torch.tensor([[seq[s]]], device=device), **{kw: past}, use_cache=True)
                past = getattr(out, kw)
                cur["logits"] = out.logits[0, -1].to(torch.float32).cpu().numpy().copy()
                missing = [n for n in names if n not in cur]
                if missing:
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


def generate_truth(model_dir: str | Path, out_dir: str | Path, prompt: str | None = None, steps: int = DEFAULT_STEPS,
                   prompt_ids: list[int] | None = None, device: str | None = None, formats=("fp16", "fp8"),
                   console=None) -> dict:
    """Run HF transformers (fp32, eager) on `model_dir` and write DIR/truth.safetensors + DIR/truth.json.

    Variant fp16 (always): greedy from the prompt. Variant fp8 (if in `formats`): the same model with the fp8
    weight values, teacher-forced on fp16's tokens. Returns the manifest. `device`: cuda | cpu | None (cuda when
    torch sees a device).
    """
    torch, transformers = require_truth_deps()
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
    with quiet(transformers):  # transformers' warnings and log lines are not ours to print
        model = _load_hf(model_dir, device)
        new, runs = _hf_run(model, prompt_ids, steps, device)
        runs = {"fp16": runs}
        predicted = {"fp16": new}
        if "fp8" in variants:
            _to_fp8_values(model, ckpt)
            predicted["fp8"], runs["fp8"] = _hf_run(model, prompt_ids, steps, device, forced=prompt_ids + new)
    del model
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
        os.chmod(tmp, store.umasked())  # mkstemp's 0600 otherwise
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


# ---- storage ----------------------------------------------------------------------------------------------------
class Truth:
    """A ground-truth directory: `manifest` (truth.json) and `get(variant, position, probe)` (float32)."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        path = self.dir / TRUTH_JSON
        try:
            self.manifest = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{self.dir}: no {TRUTH_JSON} (validate --truth DIR makes one in an empty DIR)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({getattr(e, 'msg', None) or e.reason})") from None
        if schemas.check(self.manifest, ("truth",), path) is None:
            raise ConfigError(f"{path}: not an {TRUTH_SCHEMA} manifest")
        missing = [k for k in ("prompt_ids", "generated_ids", "steps", "variants", "transformers", "torch", "device")
                   if k not in self.manifest]
        if missing:
            raise ConfigError(f"{path}: lacks {missing[0]!r}")
        if not (self.dir / TRUTH_TENSORS).is_file():
            raise ConfigError(f"{self.dir}: {TRUTH_TENSORS} is missing")
        try:
            self._st = safe_open(str(self.dir / TRUTH_TENSORS), framework="numpy")
        except Exception as e:  # SafetensorError: truncated or garbage
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"{self.dir / TRUTH_TENSORS}: not readable ({why})") from None
        want = self.manifest["positions"] * len(self.manifest["variants"]) * len(self.manifest.get("probes", [])) \
            if isinstance(self.manifest.get("positions"), int) else None
        if want is not None and len(list(self._st.keys())) != want:
            raise ConfigError(f"{self.dir / TRUTH_TENSORS}: holds {len(list(self._st.keys()))} tensors, "
                              f"{TRUTH_JSON} says {want}")

    @property
    def sequence(self) -> list[int]:
        """The token stream the engine is teacher-forced on: the prompt, then HF's greedy tokens."""
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
    phash = hashlib.sha256(json.dumps(prompt_ids).encode()).hexdigest()[:10]
    name = re.sub(r"[^A-Za-z0-9._]+", "-", model_name(model_dir)).strip("-") or "model"
    return store.home() / "truth" / f"{name[-48:]}-{whash[:12]}-p{phash}-s{steps}"


def find_or_make_truth(model_dir: Path, vocab_size: int, whash: str, truth_dir=None, steps: int | None = None,
                       prompt: str | None = None, console=None) -> Truth:
    """The truth in `truth_dir` (its steps and prompt must match what is asked), else the cached one for this model,
    prompt and steps, else a new one made there (needs torch and transformers)."""
    if truth_dir is not None and (Path(truth_dir) / TRUTH_JSON).is_file():
        t = Truth(truth_dir)
        m = t.manifest
        if steps is not None and steps != m["steps"]:
            raise ConfigError(f"{truth_dir}: the ground truth has {m['steps']} steps, --steps asks {steps} "
                              "(omit --steps, or point --truth at a new directory)")
        if prompt is not None and prompt != m.get("prompt"):
            raise ConfigError(f"{truth_dir}: the ground truth was made for prompt {m.get('prompt')!r}, not {prompt!r}")
        Checkpoint(model_dir).config.check_positions(len(m["prompt_ids"]) + int(m["steps"]),
                                                     f"the ground truth's prompt + steps ({truth_dir})")
        if console is not None:
            console.print(f"ground truth: {truth_dir} (transformers {m['transformers']}, torch {m['torch']}, "
                          f"{m['device']})")
        return t
    steps = DEFAULT_STEPS if steps is None else steps
    prompt_ids, text = choose_prompt(model_dir, vocab_size, prompt)
    Checkpoint(model_dir).config.check_positions(len(prompt_ids) + steps,
                                                 f"a prompt of {len(prompt_ids)} tokens + --steps {steps}")
    if truth_dir is None:
        truth_dir = default_truth_dir(model_dir, whash, prompt_ids, steps)
        if (truth_dir / TRUTH_JSON).is_file():
            try:
                cached = Truth(truth_dir)
            except (ConfigError, OSError, UnicodeDecodeError) as e:  # corrupt or truncated: made again below
                print(f"warning: cached ground truth unreadable ({str(e).splitlines()[0]}); making it again",
                      file=sys.stderr, flush=True)
            else:
                if console is not None:
                    console.print(f"ground truth: reusing {truth_dir}")
                return cached
    try:
        require_truth_deps()
    except TruthUnavailable as e:
        raise TruthUnavailable(f"no ground truth given and none can be made here: {e}; or make it where they "
                               "are installed (`atomflow-bench validate MODEL --truth DIR` fills an empty DIR; add "
                               "--backend numpy where there is no GPU), copy DIR here and pass --truth DIR") from None
    generate_truth(model_dir, truth_dir, prompt=text, steps=steps, prompt_ids=prompt_ids, console=console)
    if console is not None:
        console.print(f"ground truth written to {truth_dir}")
    return Truth(truth_dir)
