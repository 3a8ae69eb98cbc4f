"""A job's options on the command line, shared by `cleave train` (run it here) and `cleave submit` (run it on the
hub), and the job they describe."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

FLAGS = {"round_timeout_s": "--round-timeout"}  # a job setting whose option is not --its-name-with-dashes


def register(p: argparse.ArgumentParser) -> None:
    """Add the options that describe a job (not where or how it runs) to `p`."""
    p.add_argument("--preset", help="a model preset: tiny (default), tiny-llama, small, gpt2-medium, llama3-1b")
    p.add_argument("--config", type=Path, help="a settings file: the job (TOML top-level keys, or JSON) and the "
                   "services' tables ([ps], [worker], ...); flags win (docs/user-guide.md, 'Settings file')")
    p.add_argument("--steps", type=int, help="training steps (default 20; for diloco and fedavg, rounds)")
    p.add_argument("--job-id", help="names the job and its persisted state; the same id resumes it "
                                    "(default: a new id)")
    p.add_argument("--seed", type=int, help="seeds the weights and the batches (default 0)")
    p.add_argument("--batch-size", type=int, help="sequences per step (default 8)")
    p.add_argument("--lr", type=float, help="AdamW's peak learning rate, warmed up and decayed by a cosine "
                                            "(default 2e-3)")
    p.add_argument("--data", help="builtin (default: Python's own documentation), a text file, folder, glob, "
                                  "data.jsonl[:field], hf:..., or tokens.u16/.u32/.bin")
    p.add_argument("--tokenizer", help="bytes (default), a tokenizer dir or tokenizer.json, or a cached repo id")
    p.add_argument("--init-from", help="a Hugging Face model dir to start from (fine-tuning)")
    p.add_argument("--method", choices=("cleave", "diloco", "fedavg", "split"), help="how to train (default cleave)")
    p.add_argument("--split-layers", type=int, help="split learning: blocks the client keeps (default 1)")
    p.add_argument("--local-steps", type=int, help="diloco H / fedavg E: local steps per round (default 10)")
    p.add_argument("--outer-lr", type=float, help="diloco's outer learning rate (default 1: plain averaging)")
    p.add_argument("--outer-momentum", type=float, help="diloco's outer Nesterov momentum (default 0)")
    p.add_argument("--diloco-setting", choices=("default", "paper", "plain"),
                   help="diloco's H, outer lr and momentum by name (the flags above win): default (measured on "
                        "small), paper (H 500, 0.7, Nesterov 0.9), plain (outer lr 1, no momentum)")
    p.add_argument("--round-timeout", type=float, dest="round_timeout_s",
                   help="diloco/fedavg: a round closes with what arrived after this many seconds (120)")
    p.add_argument("--max-staleness", type=int, help="diloco/fedavg: late updates up to this many rounds old "
                                                     "count, weighted 1/(1+age) (default 0: dropped)")
    p.add_argument("--min-updates", type=int, help="diloco/fedavg: a round closes once this many updates "
                                                   "arrived (default 0: every worker of the plan)")
    p.add_argument("--val-every", type=int, help="validation loss of the PS's model every N steps or rounds "
                                                     "(default 0: never)")
    p.add_argument("--aggregate", choices=("mean", "median", "trimmed"), help="how round updates combine (default mean)")
    p.add_argument("--compress", help="updates on the uplink: none, fp16, bf16, int8[:BLOCK], topk:FRACTION, "
                   "topkq:FRACTION[:BITS] (default none)")
    p.add_argument("--lora-rank", "--lora", type=int, dest="lora_rank", help="train and send only LoRA adapters of "
                   "this rank")
    p.add_argument("--lora-alpha", type=float, help="LoRA's scale is alpha / rank (default 16)")
    p.add_argument("--lora-targets", help="comma-separated module names to adapt (default: attention and MLP "
                                          "projections, e.g. c_attn,c_proj,c_fc or q_proj,k_proj,v_proj,o_proj,...)")
    p.add_argument("--sampling", choices=("random", "epochs"), help="batches: random windows (default) or every "
                   "window or example once per epoch, shuffled (instruction data always reads in epochs)")
    p.add_argument("--own-data", action="store_true", default=None, help="diloco/fedavg/split: train only on the "
                   "data each worker declared (cleave worker --data); a worker without is refused")
    p.add_argument("--update-clip", type=float, help="diloco/fedavg: clip every update's L2 norm to this")
    p.add_argument("--max-empty-rounds", type=int, help="diloco/fedavg: rounds in a row with no accepted update "
                                                        "before the job fails (default 4)")
    p.add_argument("--secagg", action="store_true", default=None, help="fedavg: pairwise-masked aggregation, the "
                   "PS learns only the sum of each round's updates")
    p.add_argument("--dp-noise", type=float, help="fedavg: client-level differential privacy, Gaussian noise of "
                   "this multiple of --update-clip on each round's sum; epsilon is reported per round")
    p.add_argument("--dp-delta", type=float, help="fedavg with --dp-noise: the delta epsilon is reported at (1e-5)")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), help="the GEMMs' precision (default fp32; "
                   "autocast semantics; fp16 with loss scaling); --reference runs the same precision")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the preset's block size)")
    p.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=None,
                   help="activation checkpointing: each block keeps only its input and runs its forward again "
                        "(its GEMMs dealt again) in the backward (default: only when the batch does not fit)")
    p.add_argument("--micro-batches", type=int, help="split each batch in N equal parts, gradients "
                   "accumulated (default 1)")
    p.add_argument("--logits-bytes", type=int, help="the head and loss run in chunks of tokens whose float32 logits "
                   "take at most this many bytes (default 256 MiB): less memory, the head's dW sent more often")


def job_from_args(args: argparse.Namespace, kind: str = "train"):  # noqa: ANN201 - a JobConfig (torch: imported late)
    """The job the options describe: a job file's, with every option given on top; a new id unless one is named."""
    from cleave.errors import ConfigError
    from cleave.train.job import JobConfig, new_job_id

    fields = dict(job_id=args.job_id, preset=args.preset, steps=args.steps, seed=args.seed,
                  batch_size=args.batch_size, lr=args.lr, data=args.data, method=args.method,
                  local_steps=args.local_steps, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
                  aggregate=args.aggregate, compress=args.compress, lora_rank=args.lora_rank,
                  tokenizer=args.tokenizer, init_from=args.init_from, split_layers=args.split_layers,
                  round_timeout_s=args.round_timeout_s, max_staleness=args.max_staleness,
                  min_updates=args.min_updates, val_every=args.val_every, precision=args.precision,
                  lora_alpha=args.lora_alpha, sampling=args.sampling, own_data=args.own_data,
                  update_clip=args.update_clip, max_empty_rounds=args.max_empty_rounds, secagg=args.secagg,
                  dp_noise=args.dp_noise, dp_delta=args.dp_delta, seq_len=args.seq_len, recompute=args.recompute,
                  micro_batches=args.micro_batches, logits_bytes=args.logits_bytes,
                  lora_targets=tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
                  if args.lora_targets else None)
    options = set(fields)  # the settings an option sets
    fields = {k: v for k, v in fields.items() if v is not None}
    if args.diloco_setting:  # a named (H, outer lr, momentum); explicit flags win
        from cleave.methods.diloco import SETTINGS

        named = dict(zip(("local_steps", "outer_lr", "outer_momentum"), SETTINGS[args.diloco_setting], strict=True))
        fields = {**named, **fields}
    try:
        if args.config:
            job = JobConfig.load(args.config, **fields)
            return job if "job_id" in job.model_fields_set else job.model_copy(update={"job_id": new_job_id(kind)})
        return JobConfig.build(**{"job_id": new_job_id(kind), **fields})
    except ConfigError as e:  # (with a settings file, its keys keep their names where no option set them)
        raise ConfigError(in_options(str(e), set(fields) if args.config else options)) from None


def in_options(message: str, names: set[str]) -> str:
    """A job's error in the command line's words: each of the settings `names` named as its option
    (`micro_batches=3 must divide batch_size=4` -> `--micro-batches 3 must divide --batch-size 4`)."""
    for name in sorted(names, key=len, reverse=True):
        flag = FLAGS.get(name, "--" + name.replace("_", "-"))
        message = re.sub(rf"\b{name}=", f"{flag} ", message)
        message = re.sub(rf"\bjob setting {name}\b", f"option {flag}", message)
        if "_" in name:  # (a bare name: only one no word of English can be)
            message = re.sub(rf"\b{name}\b", flag, message)
    return message
