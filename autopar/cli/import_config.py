"""``autopar import CONFIG``: a framework's config (and a model card) as
autopar model and execution files.

Reads a Megatron-LM argument list or launch script, a Megatron-Bridge / NeMo
override list, a torchtitan TOML job config, a DeepSpeed ds_config or a
Hugging Face config.json (``autopar.io.launch.read_config``; the format is
detected from the file unless ``--format`` names it) and writes the model
(``--model-out``: the model card's architecture with the config's sequence
length) and the execution (``--execution-out``: the layout the config runs,
the framework spec's defaults for what it leaves out, and ``null`` for what
it does not say: a partial layout, for ``autopar estimate --partial``).
Both files or neither: they are written through ``autopar.io.writers`` under
the command's all-or-nothing.
"""
from __future__ import annotations

from autopar.cli import SOURCE, distinct_outputs, output_path, positive
from autopar.io.errors import SpecError

EXAMPLE = """example:
  autopar import train.toml --model-card config.json \\
      --model-out model.json --execution-out execution.json
  autopar estimate model.json systems/h100_80g_nvl8.json execution.json \\
      --framework torchtitan --partial
"""


def register(subparsers) -> None:
    import argparse
    from autopar.io.launch import READ_FORMATS
    p = subparsers.add_parser(
        "import", help="read a framework's config into autopar model and execution files",
        description="Read a framework's config (Megatron-LM arguments, Megatron-Bridge / NeMo "
                    "overrides, a torchtitan TOML, a DeepSpeed ds_config) and/or a Hugging Face "
                    "config.json, and write autopar's model and execution files (both or "
                    "neither). Fields the config does not state are written as null (unknown): "
                    "estimate them with `autopar estimate ... --partial`.",
        epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="the framework's config file (or a Hugging Face config.json)")
    p.add_argument("--format", default=None, metavar="|".join(READ_FORMATS),
                   help="the config's format (default: detected from the file)")
    p.add_argument("--model-card", default=None, metavar="config.json",
                   help="a Hugging Face config.json giving the model's architecture")
    p.add_argument("--model-out", default=None, metavar="M.json",
                   help="write the autopar model file here")
    p.add_argument("--execution-out", default=None, metavar="E.json",
                   help="write the autopar execution file here")
    p.add_argument("--num-procs", type=int, default=None, metavar="N",
                   help="processors, where the config does not state them (e.g. torchtitan's "
                        "data_parallel_shard_degree = -1)")
    p.add_argument("--seq-len", type=int, default=None, metavar="S",
                   help="the training sequence length (default: the config's, else the model "
                        "card's max_position_embeddings)")
    p.set_defaults(func=run)


def run(args) -> int:
    from autopar.io import writers
    from autopar.io.launch import read_config, settle
    from autopar.io.layouts import ALL_FIELDS, EXT_DEFAULTS, FIELDS
    from autopar.io.specs import load_model, load_partial_execution, model_to_json

    positive("--num-procs", args.num_procs)
    positive("--seq-len", args.seq_len)
    model_out = output_path("--model-out", args.model_out)
    exec_out = output_path("--execution-out", args.execution_out)
    distinct_outputs({"--model-out": model_out, "--execution-out": exec_out})
    if model_out is None and exec_out is None:
        raise SpecError(SOURCE, "--model-out", "give --model-out and/or --execution-out")

    fmt, imported = read_config(args.config, args.format, num_procs=args.num_procs)
    model_fields: dict = {}
    card_notes: tuple = ()
    if fmt == "hf":
        if args.model_card is not None:
            raise SpecError(SOURCE, "--model-card", f"{args.config} is itself a model card")
        if exec_out is not None:
            raise SpecError(SOURCE, "--execution-out", f"{args.config} is a Hugging Face "
                            "config.json: a model, not a layout")
        model_fields = dict(imported.model)
    elif args.model_card is not None:
        _, card = read_config(args.model_card, "hf")
        model_fields, card_notes = dict(card.model), card.notes
    model_fields.update({k: v for k, v in imported.model.items() if fmt != "hf"})
    if args.seq_len is not None:
        model_fields["seq_size"] = args.seq_len
    elif "seq_size" in model_fields and "seq_size" not in imported.model:
        card_notes += (f"seq_size {model_fields['seq_size']}: the model card's context "
                       "(max_position_embeddings); give --seq-len for the training sequence",)
    model = None
    if {"hidden", "num_blocks"} <= set(model_fields):
        model = load_model(model_fields, source=args.model_card or args.config)
    elif model_out is not None:
        raise SpecError(SOURCE, "--model-card", f"{args.config} does not give the model's "
                        "architecture; give a Hugging Face config.json")

    for note in card_notes + imported.notes:
        print(f"note: {note}")
    if model_out is not None:
        writers.write_json(model_to_json(model), model_out)
        print(f"model: {model_out}")
    if exec_out is None:
        return 0

    ex = dict(imported.execution)
    if "num_procs" not in ex or ex["num_procs"] is None:
        if args.num_procs is None:
            raise SpecError(SOURCE, "--num-procs", f"{args.config} does not state the number "
                            "of processors; give --num-procs")
        ex["num_procs"] = args.num_procs
    elif args.num_procs is not None and args.num_procs != ex["num_procs"]:
        raise SpecError(SOURCE, "--num-procs", f"{args.num_procs}, but {args.config} runs on "
                        f"{ex['num_procs']}")
    if ex.get("data_par") is None:
        par = ex.get("tensor_par", 1) * ex.get("pipeline_par", 1) * ex.get("context_par", 1)
        if ex["num_procs"] % par:
            raise SpecError(SOURCE, "--num-procs", f"{ex['num_procs']} is not a multiple of "
                            f"tensor x pipeline x context parallelism ({par})")
        ex["data_par"] = ex["num_procs"] // par
    if model is not None:
        ex = settle(fmt, ex, model)
    defaults = {}
    if imported.framework:
        from autopar.io.frameworks import load_framework
        defaults = dict(load_framework(imported.framework).defaults)
    for f, v in defaults.items():
        ex.setdefault(f, v)
    for f in FIELDS:                      # what the config does not say: unknown
        ex.setdefault(f, None)
    for f in ("num_procs", "batch_size", "datatype", "training"):
        if ex.get(f) is None:
            raise SpecError(args.config, f, "the config does not state it (a partial layout "
                            "must: it defines the case)")
    # the file as autopar reads it (checked), unknown fields as null
    stated, unknown = load_partial_execution(ex, source=args.config, model=model)
    out = {f: None for f in unknown}
    out.update(stated)
    out = {f: out[f] for f in ALL_FIELDS if f in out
           and not (f in EXT_DEFAULTS and out[f] == EXT_DEFAULTS[f] and f not in unknown)}
    writers.write_json(out, exec_out)
    if imported.framework:
        print(f"framework: {imported.framework} (estimate with --framework {imported.framework})")
    print(f"execution: {exec_out}" + (f" ({len(unknown)} unknown: {', '.join(unknown)})"
                                      if unknown else ""))
    return 0
