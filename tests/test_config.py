"""ModelConfig: catalog shapes, field-by-field validation, and RoPE frequencies against transformers."""
import json

import numpy as np
import pytest

from atomflow_bench.config import CATALOG, ModelConfig, get_preset
from atomflow_bench.errors import ConfigError

# Parameter counts published for the real checkpoints.
PUBLISHED_PARAMS = {"llama-3.2-1b": 1.236e9, "llama-3.2-3b": 3.213e9, "llama-3.1-8b": 8.03e9,
                    "smollm2-135m": 134.5e6,
                    "llama-3.1-70b": 70.55e9, "llama-3.1-405b": 405.85e9}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_preset_param_counts(name):
    assert CATALOG[name].config.param_count() == pytest.approx(PUBLISHED_PARAMS[name], rel=0.005)


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_hf_dict_round_trip(name, tmp_path):
    cfg = CATALOG[name].config
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    assert ModelConfig.from_file(tmp_path / "config.json") == cfg


def test_fp8_bytes_are_about_half():
    cfg = CATALOG["llama-3.1-8b"].config
    assert 0.5 < cfg.weight_bytes("fp8") / cfg.weight_bytes("fp16") < 0.6


def _base() -> dict:
    return CATALOG["llama-3.2-1b"].config.to_hf_dict()


@pytest.mark.parametrize("change, field", [
    ({"model_type": "mistral"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"vocab_size": None}, "vocab_size"),
    ({"num_key_value_heads": 5}, "num_key_value_heads"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"hidden_size": -1}, "hidden_size"),
])
def test_bad_config_names_the_field(change, field):
    d = _base()
    for k, v in change.items():
        if v is None:
            del d[k]
        else:
            d[k] = v
    with pytest.raises(ConfigError, match=f"'{field}'"):
        ModelConfig.from_hf_dict(d)


def test_bad_json_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_file(tmp_path / "config.json")
    with pytest.raises(ConfigError, match="not found"):
        ModelConfig.from_file(tmp_path / "missing.json")


def test_unknown_preset_lists_catalog():
    with pytest.raises(ConfigError, match="llama-3.2-3b"):
        get_preset("llama-9")


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_rope_inv_freq_matches_transformers(name):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = CATALOG[name].config
    hf = LlamaConfig(**cfg.to_hf_dict())
    if cfg.rope_scaling is None:
        want = LlamaRotaryEmbedding(config=hf).inv_freq
    else:
        want, _ = ROPE_INIT_FUNCTIONS[cfg.rope_scaling["rope_type"]](hf, "cpu")
    ours = cfg.rope_inv_freq()
    assert ours.dtype == np.float32 and ours.shape == (cfg.head_dim // 2,)
    # float32 pow differs by at most an ulp between numpy and torch
    np.testing.assert_allclose(ours, want.numpy(), rtol=3e-7, atol=0)
