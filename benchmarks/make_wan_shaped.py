"""Write a diffusers folder shaped like Wan2.1-T2V-1.3B, with random weights, for GPU runs of the
trainer where the real weights cannot be downloaded (the multi-GPU trainer runs).

The transformer has the real 1.3B configuration (``bench_e2e.WAN_1_3B``) and the VAE the real
``AutoencoderKLWan`` architecture, so time and memory are those of the real model. The text side
is a stand-in: a word-level tokenizer over a few words and a one-layer UMT5 encoder with the
real 4096-wide output, which changes nothing in the DiT's cost.

    python benchmarks/make_wan_shaped.py /tmp/wan1.3b
"""

from __future__ import annotations

import argparse
import os

import torch
from bench_e2e import WAN_1_3B

WORDS = ["<pad>", "</s>", "<unk>", "a", "red", "blue", "square", "circle", "moving", "left"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out", help="folder to create (model.path of the run)")
    args = p.parse_args(argv)
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    os.makedirs(args.out, exist_ok=True)
    transformer = WanTransformer3DModel(**WAN_1_3B).to(torch.bfloat16)
    transformer.save_pretrained(os.path.join(args.out, "transformer"))
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(os.path.join(args.out, "tokenizer"))
    text_config = UMT5Config(
        vocab_size=len(WORDS), d_model=WAN_1_3B["text_dim"], d_kv=16, d_ff=64, num_layers=1,
        num_heads=2, relative_attention_num_buckets=8,
    )  # fmt: skip
    UMT5EncoderModel(text_config).save_pretrained(os.path.join(args.out, "text_encoder"))
    AutoencoderKLWan().save_pretrained(os.path.join(args.out, "vae"))
    print(f"wrote a Wan-1.3B-shaped diffusers folder with random weights to {args.out}")


if __name__ == "__main__":
    main()
