"""``autopar estimate MODEL SYSTEM EXECUTION [--json]``: one layout, explained.

Predicts the batch time, memory and efficiency of one execution of one model
on one system.  Exit 0 when the layout can run, 1 when it cannot (the reason
on one line), 2 on bad input.

A partial layout (a field given as ``null`` or ``"?"``, or, with
``--partial``, any of Calculon's fields left out) is predicted over every
completion of its unknown fields (``autopar.search.partial``): the stated
fields, each unknown field's value in the best completion, whether some
completion fits, and the spread; exit 0 when some completion fits, 1 when
none does.

``--output FILE [--format F]`` writes the (complete) execution in ``F``
(``autopar.io.export``: autopar, calculon, or a framework's launch config such
as ``megatron``) when it can run: a layout turned into the framework's
arguments.  What ``F`` cannot express is refused in one line before the
prediction; nothing is written for a layout that cannot run.
"""
from __future__ import annotations

from autopar.cli import framework_option

import json

from autopar.io.specs import load_execution, load_model, load_partial_execution, load_system

GiB = 1024 ** 3

def register(subparsers) -> None:
    p = subparsers.add_parser(
        "estimate", help="predict time and memory of one layout",
        description="Predict batch time, memory per tier and efficiency of one "
                    "execution (Calculon JSON files). Exit 0 when the layout can "
                    "run, 1 when it is invalid or infeasible (the reason on one "
                    "line), 2 on bad input.")
    p.add_argument("model", help="model (application) JSON file")
    p.add_argument("system", help="system JSON file")
    p.add_argument("execution", help="execution JSON file (Calculon's 23 fields)")
    p.add_argument("--json", action="store_true",
                   help="print the statistics as one JSON object")
    p.add_argument("--memory-headroom", type=float, default=None, metavar="GiB",
                   help="memory margin a layout must leave below tier 1's capacity to be "
                        "recommended (default: the system's memory_headroom, else 0); "
                        "the report says whether the layout fits with it")
    p.add_argument("--partial", action="store_true",
                   help="a field the execution leaves out is unknown, as one given as null "
                        "or \"?\": predict every completion of the unknown fields and "
                        "report whether any fits, the best and the spread (exit 0 when "
                        "some completion fits)")
    p.add_argument("--space", default=None, metavar="FILE",
                   help="partial layouts: the values each unknown field may take, as this "
                        "space file allows them (default: every value autopar's rules "
                        "allow)")
    from autopar.io.export import DEFAULT_FORMAT, FORMATS, HELP as FORMAT_HELP
    p.add_argument("--output", metavar="FILE", default=None,
                   help="write this execution (in --format) when it can run: e.g. a "
                        "layout turned into its Megatron-LM arguments")
    p.add_argument("--format", choices=FORMATS, default=None,
                   help=f"with --output (default {DEFAULT_FORMAT}): " + FORMAT_HELP)
    from autopar.search.risk import add_arguments
    add_arguments(p)
    framework_option(p)
    p.set_defaults(func=run)


def estimate(model, system, execution) -> dict:
    """Evaluate one execution: {'feasible', 'reason', <every stat>}."""
    from autopar import model as perf
    from autopar.io.writers import json_value

    res = perf.evaluate_one(model, system, execution)
    out = {"feasible": bool(res["feasible"]), "reason": perf.REASONS[int(res["reason_code"])]}
    for k in perf.STATS:
        out[k] = json_value(res[k])
    return out


def _output(args):
    """``--output``/``--format``: the file and the format, checked first."""
    from autopar.cli import output_path
    from autopar.io.specs import SpecError
    fmt = getattr(args, "format", None)
    out = output_path("--output", getattr(args, "output", None))
    if fmt is not None and out is None:
        raise SpecError("command line", "--format", "says how --output is written; give "
                        "--output FILE")
    if out is not None and args.partial:
        raise SpecError("command line", "--output", "writes a complete execution; this one "
                        "is partial (--partial)")
    return out, fmt or "autopar"


def run(args) -> int:
    out, fmt = _output(args)
    model = load_model(args.model)
    from autopar.io.frameworks import check_options, load_framework, with_framework
    framework = load_framework(args.framework) if args.framework else None
    system = with_framework(load_system(args.system), framework)
    defaults = framework.defaults if framework is not None else None
    stated, unknown = load_partial_execution(args.execution, system=system, model=model,
                                             missing_unknown=args.partial, defaults=defaults)
    if unknown or args.partial:
        if out is not None:
            from autopar.io.specs import SpecError
            raise SpecError(args.execution, ", ".join(unknown) or "execution",
                            "--output writes a complete execution; this one leaves fields "
                            "unknown")
        return run_partial(args, model, system, stated, unknown, framework)
    if args.space is not None:
        from autopar.io.specs import SpecError
        raise SpecError("command line", "--space", "gives the options of a partial layout's "
                        "unknown fields; this execution states every field (use --partial, "
                        "or null or \"?\" for a field)")
    execution = load_execution(args.execution, system=system, model=model, defaults=defaults)
    check_options(framework, execution, args.execution)
    text = None
    if out is not None:              # refused in one line before anything is evaluated
        from autopar.io.export import check_run, written
        check_run(fmt, model, None, execution["datatype"])
        text = written(execution, fmt, model)[0]
    from autopar.search.headroom import band_gib, fits, headroom_gib
    from autopar.search.risk import layout_risk, risk_of
    headroom = headroom_gib(system, args.memory_headroom)
    risk = risk_of(args)
    result = estimate(model, system, execution)
    peak = result.get("proc_mem_tier1_cap_req")
    result["memory_headroom_GiB"] = headroom
    result["memory_band_GiB"] = band_gib(system)
    result["fits_with_headroom"] = bool(result["feasible"] and peak is not None
                                        and fits(peak, system, headroom))
    if result["feasible"]:
        result.update(layout_risk(model, system, execution, peak, result["sample_rate"], risk))
    if args.json:
        print(json.dumps(result, indent=2))
    elif result["feasible"]:
        print(report(model, system, execution, result, headroom))
    else:
        print(result["reason"])
    if text is not None and result["feasible"]:
        from autopar.io.writers import write_text
        write_text(text, out)
    return 0 if result["feasible"] else 1


def run_partial(args, model, system, stated: dict, unknown: tuple, framework=None) -> int:
    """``estimate`` of a partial layout: every completion of its unknown fields
    (with a framework: of the values it can express, its recipe's default
    first, so that it wins ties)."""
    from autopar.search.headroom import headroom_gib
    from autopar.search.partial import complete, default_options, defaults_first

    headroom = headroom_gib(system, args.memory_headroom)
    options = default_options(unknown, args.space)
    if framework is not None:
        options.update({f: framework.options[f] for f in unknown
                        if f in framework.options and args.space is None})
        options = defaults_first(options, framework.defaults)
    res = complete(model, system, stated, unknown, options, source=str(args.execution),
                   options_source=str(args.space or "options"))
    if args.json:
        out = {"partial": True, **res.to_json()}
        if res.best is not None:
            out["best_stats"] = estimate(model, system, res.best.execution)
        print(json.dumps(out, indent=2))
    else:
        print(partial_report(res))
        if res.best is not None:
            print()
            print("best completion:")
            print(report(model, system, res.best.execution,
                         estimate(model, system, res.best.execution), headroom))
    return 0 if res.fits else 1


def _values(d: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items())


def partial_report(res) -> str:
    """The summary of a partial layout's completions."""
    from autopar.io.layouts import EXT_DEFAULTS
    stated = {k: v for k, v in res.stated.items()
              if k not in EXT_DEFAULTS or v != EXT_DEFAULTS[k]}
    lines = [f"stated   {_values(stated)}"]
    # each unknown field's value in the best completion, else (none fits) in
    # the memory-lowest one
    pick = res.best if res.best is not None else res.lowest_memory
    which = "the best completion" if res.best is not None else "the memory-lowest completion"
    for f in res.unknown:
        got = pick.chosen[f] if pick is not None else "-"
        if f not in res.options:          # derived (data_par)
            lines.append(f"unknown  {f}: {got} (derived from the others)")
            continue
        o = res.options.get(f)
        opts = "every value the rules allow" if o is None else (
            ", ".join(map(str, o)) if isinstance(o, tuple) else str(o))
        lines.append(f"unknown  {f}: {got} in {which} (options: {opts})")
    lines.append(f"fits     {'yes' if res.fits else 'no'}: {res.feasible} of "
                 f"{res.completions} completions predicted to fit")
    if res.fits:
        r, m = res.spread["sample_rate"], res.spread["mem_gib"]
        lines.append(f"spread   sample rate {r[0]:.4g} / {r[1]:.4g} / {r[2]:.4g} samples/s, "
                     f"tier-1 memory {m[0]:.2f} / {m[1]:.2f} / {m[2]:.2f} GiB "
                     f"(min / median / max over the fitting completions)")
    low = res.lowest_memory
    if low is not None:
        lines.append(f"lowest   memory: {_values(low.chosen) or 'the stated layout'}: "
                     f"{low.mem_gib:.2f} GiB"
                     + ("" if low.feasible else f" ({low.reason})"))
    if not res.fits:
        lines.append(res.reason)
    return "\n".join(lines)


def _get(stats: dict, key: str) -> float:
    v = stats.get(key)
    return float(v) if v is not None else float("nan")


def memory_rows(model, execution, stats: dict) -> list[tuple[str, float, float]]:
    """(label, bytes in tier 1, bytes in tier 2) per kind of data.

    The ``*_with_offload`` statistics are what stays in tier 1 when that kind
    of data is offloaded; the plain ones are its full size (Calculon's
    convention).  The rows add up to the tier requirements.  A missing (null)
    statistic counts as 0: Calculon reports no checkpoint size in inference.
    """
    e = execution

    def g(key: str) -> float:
        v = stats.get(key)
        return 0.0 if v is None else float(v)

    full_recompute = e["activation_recompute"] == "full"
    rows = []
    if e["weight_offload"]:
        rows.append(("weights", g("weight_space_with_offload"), g("weight_space")))
    else:
        rows.append(("weights", g("weight_space"), 0.0))
    if e["activations_offload"]:
        rows.append(("activations", g("act_space_with_offload"),
                     0.0 if full_recompute else g("act_space")))
        rows.append(("act checkpoints", g("act_checkpoint_size_with_offload"),
                     g("act_checkpoint_size") if full_recompute else 0.0))
    else:
        # partial CPU offloading: that many blocks' saved activations on the host
        host = e.get("activation_offload_blocks", 0) * g("block_act_storage_space")
        rows.append(("activations", g("act_space"), host))
        rows.append(("act checkpoints", g("act_checkpoint_size"), 0.0))
    if e["optimizer_offload"]:
        blocks_per_proc = model.num_blocks / e["pipeline_par"]
        rows.append(("weight grads", g("weight_grad_space_with_offload"),
                     g("block_weight_grad_space") * blocks_per_proc))
        rows.append(("optimizer", g("optimizer_space_with_offload"), g("optimizer_space")))
    else:
        rows.append(("weight grads", g("weight_grad_space"), 0.0))
        rows.append(("optimizer", g("optimizer_space"), 0.0))
    rows.append(("act grads", g("act_grad_space"), 0.0))
    if not e["activations_offload"] and e.get("activation_offload_modules", "none") != "none":
        # fine-grained offloading: the offloaded modules' saved tensors in
        # host memory, what the tier-2 requirement holds beyond the rows above
        rest = sum(r[2] for r in rows)
        rows = [(n, t1, t2 + max(g("proc_mem_tier2_cap_req") - rest, 0.0)
                 if n == "activations" else t2) for n, t1, t2 in rows]
    return rows


def report(model, system, execution, stats: dict, headroom: float = 0.0) -> str:
    """A readable report of one evaluated layout."""
    e = execution
    lines = []
    add = lines.append
    add(f"model   {model.name or model.source}: {model.num_blocks} blocks, hidden "
        f"{model.hidden}, feedforward {model.feedforward}, {model.attn_heads} heads x "
        f"{model.attn_size}, seq {model.seq_size}"
        + (f", {model.block} block" if model.block != "gpt" else "")
        + (f", {model.kv_heads} kv heads" if model.kv_heads else ""))
    if model.moe is not None:
        mo = model.moe
        add(f"        MoE: {mo.experts} experts x {mo.expert_feedforward}, top-{mo.top_k}"
            + (f", {mo.shared_experts} shared ({mo.shared_feedforward})" if mo.shared_experts
               else "")
            + (f", first {mo.first_dense} blocks dense" if mo.first_dense else "")
            + (f", on a latent of {mo.latent_size}" if mo.latent_size else "")
            + (", MLA" if model.mla is not None else "")
            + (f" with sparse attention (indexer {model.mla.sparse_index.n_heads} x "
               f"{model.mla.sparse_index.head_dim}, top {model.mla.sparse_index.topk})"
               if model.mla is not None and model.mla.sparse_index is not None else "")
            + (f", {model.mtp} MTP" if model.mtp else "")
            + (f" '{model.mtp_pattern}'" if model.mtp and model.mtp_pattern else "")
            + (" (one module repeated)" if model.mtp and model.mtp_repeated else ""))
    add(f"system  {system.name or system.source}: {system.processing_mode}, "
        f"{len(system.networks)} network tiers, mem1 {system.mem1.GiB:g} GiB, "
        f"mem2 {system.mem2.GiB:g} GiB")
    add(f"layout  {e['num_procs']} procs = TP {e['tensor_par']} (net {e['tensor_par_net']})"
        f" x PP {e['pipeline_par']} (net {e['pipeline_par_net']})"
        f" x DP {e['data_par']} (net {e['data_par_net']})"
        + (f" x CP {e['context_par']} (net {e.get('context_par_net', 0)}, "
           f"{e.get('context_par_comm', 'p2p')})" if e.get("context_par", 1) > 1 else "")
        + f"; batch {e['batch_size']},"
        f" microbatch {e['microbatch_size']}, {e['datatype']}"
        f"{'' if e['training'] else ', inference'}")
    flags = [f"recompute={e['activation_recompute']}",
             f"attention={e['attention_type']}",
             f"interleaving={e['pipeline_interleaving']}",
             f"tp_comm={e['tensor_par_comm_type']}",
             f"tp_overlap={e['tensor_par_overlap']}"]
    flags += [f for f in ("fused_activation", "optimizer_sharding", "seq_par_ag_redo",
                          "data_par_overlap", "weight_offload", "activations_offload",
                          "optimizer_offload") if e[f]]
    flags += [f for f in ("unsharded_grads", "weight_sharding", "fp32_grads",
                          "param_gather_overlap", "optimizer_outer_sharding") if e.get(f)]
    flags += [f"{f}={e[f]}" for f in ("sharding_group", "recompute_layers", "fp8_recipe",
                                      "attention_impl", "pipeline_layout",
                                      "first_stage_blocks", "last_stage_blocks",
                                      "bf16_first_blocks", "bf16_last_blocks",
                                      "activation_offload_blocks",
                                      "activation_offload_modules") if f in e]
    flags += [f for f in ("embedding_in_split", "loss_in_split") if e.get(f)]
    add("        " + ", ".join(flags))
    if e.get("expert_par", 1) > 1 or e.get("expert_tensor_par", 1) > 1:
        add(f"        EP {e.get('expert_par', 1)} (net {e.get('expert_par_net', 0)}) x ETP "
            f"{e.get('expert_tensor_par', 1)} (net {e.get('expert_tensor_par_net', 0)}), "
            f"dispatcher {e.get('moe_dispatcher', 'alltoall')}"
            + (", overlapped" if e.get("moe_overlap") else ""))

    add("")
    add(f"{'memory per processor (GiB)':<28}{'tier 1':>12}{'tier 2':>12}")
    for label, t1, t2 in memory_rows(model, e, stats):
        add(f"  {label:<26}{t1 / GiB:>12.2f}{t2 / GiB:>12.2f}")
    add(f"  {'requirement':<26}{_get(stats, 'proc_mem_tier1_cap_req') / GiB:>12.2f}"
        f"{_get(stats, 'proc_mem_tier2_cap_req') / GiB:>12.2f}")
    add(f"  {'capacity':<26}{system.mem1.GiB:>12.2f}{system.mem2.GiB:>12.2f}")
    from autopar.search.headroom import peak_text
    add(f"  predicted peak {peak_text(_get(stats, 'proc_mem_tier1_cap_req'), system, headroom)}")
    if "p_fits" in stats:
        from autopar.search.risk import risk_text
        ok = "meets" if stats["meets_min_p_fits"] else "below"
        add(f"  risk: {risk_text(stats)}; {ok} the safe threshold {stats['min_p_fits']:g}")

    from autopar.model.breakdown import EXTRA_TIME_ROWS, TIME_ROWS
    total = _get(stats, "total_time")
    add("")
    add(f"{'time per batch (s)':<28}{'seconds':>12}{'share':>12}")
    extra = tuple(r for r in EXTRA_TIME_ROWS if any(_get(stats, k) > 0 for k in r[1]))
    for label, keys in TIME_ROWS + extra:
        t = sum(_get(stats, k) for k in keys)
        share = t / total * 100 if total > 0 else float("nan")
        add(f"  {label:<26}{t:>12.4f}{share:>11.1f}%")
    add(f"  {'total':<26}{total:>12.4f}{100.0:>11.1f}%")
    if _get(stats, "ep_comm_link_time") > 0:
        t = _get(stats, "ep_comm_exposed_time")
        add(f"  {'EP dispatch (in fw/bw)':<26}{t:>12.4f}{t / total * 100:>11.1f}%"
            f"   (link {_get(stats, 'ep_comm_link_time'):.4f} s)")

    add("")
    add(f"efficiency   compute {_get(stats, 'compute_efficiency') * 100:.2f}%, system "
        f"{_get(stats, 'system_efficiency') * 100:.2f}%, total "
        f"{_get(stats, 'total_efficiency') * 100:.2f}%")
    rate = _get(stats, "sample_rate")
    add(f"sample rate  {rate:.4g} samples/s ({rate * model.seq_size:.4g} tokens/s)")
    return "\n".join(lines)

