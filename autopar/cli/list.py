"""``autopar list models|systems|spaces|frameworks``

What autopar ships (``autopar.io.shipped``: the project's folders, or the
wheel's package data), one line each: the name a command takes, then a short
description read from the file itself (a model's parameter count, a system's
processor, memory and matrix rate, a space's or framework's own description).
"""
from __future__ import annotations

KINDS = {"models": "models", "systems": "systems", "spaces": "search_spaces",
         "frameworks": "frameworks"}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "list", help="list the shipped models, systems, search spaces or frameworks",
        description="List what autopar ships, one line each with a short description. "
                    "A listed name is what the commands take (models/NAME.json, "
                    "systems/NAME.json, --space NAME, --framework NAME).")
    p.add_argument("kind", choices=tuple(KINDS), help="what to list")
    p.set_defaults(func=run)


def first_sentence(text: str, width: int = 90) -> str:
    """The description's first sentence, cut to ``width`` characters."""
    text = " ".join((text or "").split())
    for stop in (". ", ": ", "; "):
        i = text.find(stop)
        if 0 < i < len(text):
            text = text[:i]
    if text.count("(") > text.count(")"):      # a parenthesis cut open: drop it
        text = text[:text.rfind("(")].rstrip(" ,;")
    if len(text) > width:
        text = text[:width - 3].rstrip() + "..."
    return text


def _billions(n: float) -> str:
    if n >= 1e12:
        return f"{n / 1e12:.3g}T"
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def model_line(path, system) -> str:
    from autopar.io.specs import load_model
    from autopar.model.params import parameter_counts
    m = load_model(path)
    counts = parameter_counts(m, system)
    size = _billions(counts["total"]) + " parameters"
    if m.moe is not None:
        size += (f" ({_billions(counts['active'])} active; {m.moe.experts} experts, "
                 f"top-{m.moe.top_k})")
    text = (f"{size}, {m.num_blocks} blocks of hidden {m.hidden}, "
            f"sequence {m.seq_size}")
    if not m.vocab_size:
        text += ", no embedding"
    return text


def system_line(path) -> str:
    from autopar.io.specs import load_system
    s = load_system(path)
    dt = next((d for d in ("bfloat16", "float16", "float8", "float32") if d in s.matrix), None)
    rate = f", {s.matrix[dt].tflops:g} TFLOP/s {dt}" if dt else ""
    tiers = ", ".join(str(n.size) for n in s.networks)
    text = f"{s.mem1.GiB:g} GiB per processor{rate}, network tiers of {tiers}"
    desc = first_sentence(s.description, 60)
    return text + (f"; {desc}" if desc else "")


def run(args) -> int:
    from autopar.io import shipped
    kind = KINDS[args.kind]
    d = shipped.shipped_dir(kind)
    names = shipped.names(kind)
    system = None
    if kind == "models":
        from autopar.io.specs import load_system
        system = load_system(shipped.resolve("systems/a100_80g.json"))
    width = max((len(n) for n in names), default=0)
    for name in names:
        path = d / (name + shipped.KINDS[kind])
        if kind == "models":
            text = model_line(path, system)
        elif kind == "systems":
            text = system_line(path)
        elif kind == "search_spaces":
            from autopar.io.spaces import read_space
            text = first_sentence(read_space(path).description)
        else:
            from autopar.io.frameworks import load_framework
            text = first_sentence(load_framework(path).description)
        print(f"{name:<{width}}  {text}")
    return 0
