"""Checks before work (CPU): every usage and model error comes before the GPU check, so a CPU machine names the model's
fault (an unknown name, a bad config, a split over ranks the model cannot take) and not the missing driver; a
sequence past max_position_embeddings (prompt + tokens, context + tokens, prompt + steps) is refused up front by every
command, in one line, with nothing written."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers_cli import invoke

KV_HEADS = "tensor parallel over 3 ranks needs num_key_value_heads = 8 divisible by 3"
PAST = "past the model's max_position_embeddings = 256"


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("ATOMFLOW_HOME", str(h))
    return h


@pytest.fixture
def bad_dir(tmp_path) -> Path:
    d = tmp_path / "bad"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    return d


def one_line_error(code, out, err, want_code, word):
    lines = err.strip().splitlines()
    assert code == want_code, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert word in lines[0], err
    assert "driver" not in err and "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("args, word", [
    (["run", "llama-3.2-3b", "--tp", "3"], KV_HEADS),
    (["validate", "llama-3.2-3b", "--tp", "3"], KV_HEADS),
    (["profile", "llama-3.2-3b", "--tp", "3"], KV_HEADS),
    (["sweep", "--models", "llama-3.2-3b", "--tp", "1,3", "--out", "OUT"], KV_HEADS),
    (["run", "nosuch-model"], "unknown model 'nosuch-model'"),
    (["profile", "nosuch-model"], "unknown model 'nosuch-model'"),
    (["tune", "nosuch-model"], "unknown model 'nosuch-model'"),
    (["validate", "nosuch-model"], "unknown model 'nosuch-model'"),
    (["sweep", "--models", "llama-3.2-1b,nosuch-model", "--out", "OUT"], "unknown model 'nosuch-model'"),
    (["generate", "nosuch-model", "--backend", "gpu"], "unknown model 'nosuch-model'"),
    (["gemv", "nosuch-model"], "nosuch-model/config.json"),
    (["run", "BAD"], "required field 'num_attention_heads' is missing"),
    (["validate", "BAD"], "required field 'num_attention_heads' is missing"),
], ids=["run-tp3", "validate-tp3", "profile-tp3", "sweep-tp3", "run-unknown", "profile-unknown", "tune-unknown",
        "validate-unknown", "sweep-unknown", "generate-gpu-unknown", "gemv-unknown", "run-bad-config",
        "validate-bad-config"])
def test_model_errors_come_before_the_gpu_check(args, word, home, bad_dir, tmp_path, capsys):
    args = [str(bad_dir) if a == "BAD" else str(tmp_path / "out") if a == "OUT" else a for a in args]
    one_line_error(*invoke(capsys, *args), 1, word)
    assert not home.exists() or not any(home.rglob("*")), "something was written before the refusal"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, word", [
    (["run", "TINY", "--ctx", "200", "--tokens", "100"], "--ctx 200 + --tokens 100 = 300 positions"),
    (["profile", "TINY", "--ctx", "250", "--steps", "20"], "--ctx 250 + --steps 20 = 270 positions"),
    (["profile", "TINY", "--ctx", "8", "--prompt-tokens", "300"], "--prompt-tokens 300 = 300 positions"),
    (["tune", "TINY", "--ctx", "250", "--tokens", "20"], "--ctx 250 + --tokens 20 = 270 positions"),
    (["sweep", "--models", "TINY", "--ctx", "8,250", "--tokens", "20", "--out", "OUT"], "--ctx 250 + --tokens 20"),
    (["validate", "TINY", "--steps", "300", "--backend", "numpy"], "--steps 300 + a prompt token = 301 positions"),
    (["validate", "TINY", "--steps", "300"], "--steps 300 + a prompt token = 301 positions"),
    (["generate", "TINY", "--tokens", "300", "--backend", "gpu"], "--tokens 300 + a prompt token = 301 positions"),
    (["generate", "TINY", "--tokens", "250", "--prompt", " ".join(f"w{i}" for i in range(2, 12))],
     "a prompt of 11 tokens + --tokens 250 = 261 positions"),
], ids=["run", "profile", "profile-prompt", "tune", "sweep", "validate-steps-numpy", "validate-steps-gpu", "generate-gpu",
        "generate-prompt"])
def test_positions_past_the_model_are_refused_up_front(args, word, tiny_llama_dir, home, tmp_path, capsys):
    args = [str(tiny_llama_dir) if a == "TINY" else str(tmp_path / "out") if a == "OUT" else a for a in args]
    assert PAST in one_line_error(*invoke(capsys, *args), 1, word)
    assert not home.exists() or not any(home.rglob("*")), "something was written before the refusal"
    assert not (tmp_path / "out").exists()


def test_validate_refuses_prompt_plus_steps_before_making_the_truth(tiny_llama_dir, home, tmp_path, capsys):
    """--steps alone fits; the prompt's tokens take it past the model's positions: refused before the truth is made."""
    truth = tmp_path / "truth"
    prompt = " ".join(f"w{i}" for i in range(2, 12))  # <s> + 10 words = 11 tokens
    code, out, err = invoke(capsys, "validate", tiny_llama_dir, "--backend", "numpy", "--weights", "fp16", "--steps",
                            "250", "--prompt", prompt, "--truth", truth)
    one_line_error(code, out, err, 1, "a prompt of 11 tokens + --steps 250 = 261 positions")
    assert PAST in err
    assert not truth.exists() or not any(truth.iterdir())


def test_within_the_positions_nothing_is_refused(tiny_llama_dir, home, capsys):
    code, out, err = invoke(capsys, "generate", tiny_llama_dir, "--tokens", "4", "--prompt", "w5 w17")
    assert code == 0, err
    assert "w5 w17 w" in out
