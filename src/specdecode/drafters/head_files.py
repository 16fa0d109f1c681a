"""A trained head's folder: config.json (its format name + config fields) and
model.safetensors (its weights), shared by the heads of drafters/hidden_head.py
and drafters/eagle.py."""

from __future__ import annotations

import json
from pathlib import Path

import torch

WEIGHTS = "model.safetensors"


def write(folder: str | Path, fmt: str, config: dict,
          state: dict[str, torch.Tensor]) -> Path:
    """Save `state` and `config` under format name `fmt`; returns the folder."""
    from safetensors.torch import save_file
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(folder / WEIGHTS),
              metadata={"format": fmt})
    (folder / "config.json").write_text(json.dumps({"format": fmt, **config}, indent=1))
    return folder


def read(folder: str | Path, fmt: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config fields, weights) of a folder `write` made with format `fmt`
    (ValueError naming the folder when it holds another format)."""
    from safetensors.torch import load_file
    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text())
    if raw.pop("format", None) != fmt:
        raise ValueError(f"{folder} is not a {fmt} head (config.json's format)")
    return raw, load_file(str(folder / WEIGHTS))


def kind(folder: str | Path) -> str:
    """The drafter that runs the head in `folder`: "hidden-head" for a
    drafters/hidden_head.py head, else "eagle3" (ours, or the speculators format)."""
    from specdecode.drafters.hidden_head import FORMAT as HIDDEN_HEAD
    raw = json.loads((Path(folder) / "config.json").read_text())
    return "hidden-head" if raw.get("format") == HIDDEN_HEAD else "eagle3"
