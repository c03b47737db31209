"""Whole tensors read with file reads (runtime/torch_model/st_read.py) against safetensors' own
reader, and a checkpoint load that leaves none of the file's pages mapped into the process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fxsched.runtime.torch_model.hf_checkpoint import load_pretrained
from fxsched.runtime.torch_model.st_read import read_whole


def test_read_whole_equals_the_safetensors_reader(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(7, 5, generator=gen).to(torch.bfloat16),
        "b": torch.randn(3, generator=gen),
        "c": torch.randint(-9, 9, (2, 2, 2), generator=gen),
        "d": torch.randn(4, 4, generator=gen).to(torch.float16),
        "e": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 3),
    }
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path))
    with safe_open(str(path), framework="pt") as handle:
        for name in tensors:
            got = read_whole(path, name)
            assert got is not None and got.dtype == tensors[name].dtype
            assert torch.equal(got, handle.get_tensor(name)), name
    assert read_whole(path, "absent") is None


def test_truncated_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.randn(64, 64)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(ValueError, match="past the end"):
        read_whole(path, "a")


def _mapped_rss_kb(path: Path) -> int:
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1].isdigit() or line[:1] in "abcdef" and "-" in line.split()[0]:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs /proc/self/smaps (Linux)")
def test_loading_holds_no_mapped_pages_of_the_checkpoint() -> None:
    model = Path(__file__).resolve().parents[1] / "specs" / "models" / "default"
    _, weights = load_pretrained(model)
    assert weights
    assert _mapped_rss_kb((model / "model.safetensors").resolve()) < 64  # only the header page or so
