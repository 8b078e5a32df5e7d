"""The policy as a Hugging Face model directory that vLLM and transformers load: the base model's config,
safetensors weights (sharded with an index above 5 GB, as `save_pretrained` does), its tokenizer and
generation config. From a live trainer (end of training) or from any committed checkpoint:

    python -m services.learner.hf_export --checkpoint runs/x/checkpoints/step_00000040 --base MODEL --out DIR
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
from pathlib import Path

import torch

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_SHARD = "5GB"


def write_hf_model(
    out_dir: str | Path,
    weights: dict[str, torch.Tensor],
    base: str | Path,
    tokenizer_from: str | Path | None = None,
    dtype: str = "float32",
) -> Path:
    """Writes into `<out_dir>.tmp` and renames it into place, so a reader never sees half a model."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers import AutoConfig

    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = AutoConfig.from_pretrained(base)
    config.torch_dtype = DTYPES[dtype]
    weights = {name: t.to(DTYPES[dtype]).contiguous() for name, t in weights.items()}
    if getattr(config, "tie_word_embeddings", False):
        weights.pop("lm_head.weight", None)  # tied: loaders rebuild it from the embeddings
    config.save_pretrained(tmp)
    split = split_torch_state_dict_into_shards(weights, max_shard_size=MAX_SHARD)
    for file, names in split.filename_to_tensors.items():
        save_file({n: weights[n] for n in names}, tmp / file, metadata={"format": "pt"})
    if split.is_sharded:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in weights.values())},
            "weight_map": split.tensor_to_filename,
        }
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    _copy_tokenizer(tokenizer_from or base, tmp)
    if (Path(base) / "generation_config.json").is_file():
        shutil.copy(Path(base) / "generation_config.json", tmp)
    old = out.with_name(out.name + ".old")
    if out.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    return out


def _copy_tokenizer(source: str | Path, into: Path) -> None:
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(source).save_pretrained(into)
    except (OSError, ValueError) as exc:  # a weights-only base: the export is still a loadable model
        log.warning("no tokenizer copied from %s: %s", source, exc)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a committed checkpoint folder (step_<n>)")
    parser.add_argument("--base", required=True, help="the model the run started from (config and tokenizer)")
    parser.add_argument("--out", required=True, help="the model directory to write")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    args = parser.parse_args(argv)
    from services.learner.checkpoint import full_model_state

    out = write_hf_model(args.out, full_model_state(args.checkpoint), args.base, dtype=args.dtype)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
