"""`mixprec prepare`: text into token shards that train reads a window at a time."""

from __future__ import annotations

import argparse
import sys


def add(sub) -> None:
    prepare = sub.add_parser(
        "prepare", help="tokenize text once into token shards that train reads a window at a time (data.source DIR)",
        description="Tokenize SOURCE (stdlib, a text, .jsonl or .gz file, or a folder of them) into token shards "
                    "in DIR: streaming, on every core, resumable (a re-run keeps finished shards). Train on them "
                    "with --data.source DIR.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    prepare.add_argument("source", help="stdlib, a text/.jsonl/.gz file, or a folder")
    prepare.add_argument("--out", required=True, metavar="DIR", help="folder for the shards and index.json")
    prepare.add_argument("--tokenizer", default="byte", metavar="byte|bpe|PATH",
                         help="byte (UTF-8 bytes), bpe (a byte-level BPE trained on a sample of the training text), "
                              "or a Hugging Face tokenizer.json (nothing downloaded)")
    prepare.add_argument("--bpe-vocab-size", type=int, default=4096, help="vocabulary of the trained BPE")
    prepare.add_argument("--bpe-sample-mb", type=float, default=64.0, help="MB of training text the BPE learns from")
    prepare.add_argument("--val-fraction", type=float, default=0.05, help="share held out for validation")
    prepare.add_argument("--text-field", default="text", help="the text's field in .jsonl records")
    prepare.add_argument("--shard-mb", type=float, default=128.0, help="MB of text a shard (and a worker's unit)")
    prepare.add_argument("--workers", type=int, default=0, help="worker processes (0: one a core)")
    prepare.set_defaults(func=cmd_prepare)


def cmd_prepare(args: argparse.Namespace) -> int:
    from mixprec.data.prepare import run_prepare

    try:
        index = run_prepare(args.source, args.out, args.tokenizer, args.bpe_vocab_size, args.val_fraction,
                            args.text_field, args.shard_mb, args.bpe_sample_mb, args.workers)
    except KeyboardInterrupt:
        sys.stderr.write(f"mixprec prepare: interrupted; the shards finished so far are kept: run the same command "
                         f"to finish {args.out}\n")
        return 130
    print(f"prepared {args.out}: {index['tokens']['train']} training and {index['tokens']['val']} validation tokens "
          f"({index['tokenizer']['kind']} tokenizer, {index['dtype']}); train with --data.source {args.out}")
    return 0
