"""The speed comparison of `specdec bench`, in one run on the same prompts.

Methods: verifier-only decoding through the services (`autoregressive`), speculative
decoding through the services (`speculative`, one row per tree method and budget), Hugging Face assisted
generation with the same pair and weights in-process (`hf_assisted`; `hf_prompt_lookup` beside n-gram
drafters), plain `generate()` of the
served verifier's weights (`hf_generate`) and of its float32 weights (`hf_generate_fp32`, what a user
would otherwise run), and llama.cpp on the same GGUF file where it is installed. Methods
interleave on each prompt; every ratio comes with a paired 95%
bootstrap interval over prompts. Every row through the services gives its round anatomy (the
means per round of each part of a round), each hop beside a bare loopback gRPC call of its
payload; the `oracle` drafter's rows give the ceiling each plan allows.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from specdec.bench.llama_cpp import LlamaCppBinary, LlamaCppDecoder, LlamaCppMode, LlamaCppRun, verifier_gguf
from specdec.bench.llama_cpp import installed as llama_cpp_installed
from specdec.bench.loopback import loopback_call_ms
from specdec.bench.network import COLOCATED
from specdec.bench.setup import BenchSetup
from specdec.bench.stats import paired_ratio_interval, turn_order
from specdec.core.blocks import BLOCK_FORMATS
from specdec.core.ngram import is_model_free
from specdec.core.oracle import ORACLE, write_references
from specdec.core.tree import TreeShape

HF_PROMPT_LOOKUP_TOKENS = 10  # transformers' documented example value
STAGED_LOOKAHEAD = 4  # the `staged` drafter's n-gram guesses, unless the config sets its own
ANATOMY_PARTS = ("round_ms", "draft_compute_ms", "verify_compute_ms", "draft_hop_ms", "verify_hop_ms", "draft_in_service_ms",
                 "verify_in_service_ms", "coordinator_ms", "overhead_ms")
HOPS = ("draft", "verify")
IDLE_CAP_MS = 100.0  # a hop's floor stops growing with the idle time before it well before this


@dataclass
class AnatomyTally:
    """One kind of round's anatomy (RoundAnatomy) over a method's requests."""

    rounds: int = 0
    sums: Counter = field(default_factory=Counter)  # part -> ms over all rounds
    payloads: dict = field(default_factory=lambda: defaultdict(list))  # hop -> each request's mean (request, response) bytes

    def add(self, anatomy) -> None:
        if not anatomy.rounds:
            return
        self.rounds += anatomy.rounds
        for part in ANATOMY_PARTS:
            self.sums[part] += getattr(anatomy, part) * anatomy.rounds
        for hop in HOPS:
            self.payloads[hop].append((getattr(anatomy, f"{hop}_request_bytes"), getattr(anatomy, f"{hop}_response_bytes")))

    def row(self) -> dict | None:
        """Means per round; each hop's payload is the median over requests (None: no such call,
        or one in this process)."""
        if not self.rounds:
            return None
        row = {"rounds": self.rounds} | {part: self.sums[part] / self.rounds for part in ANATOMY_PARTS}
        for hop in HOPS:
            payload = [round(statistics.median(sizes)) for sizes in zip(*self.payloads[hop])]
            row[f"{hop}_payload_bytes"] = payload if any(payload) else None
        return row


@dataclass
class Tally:
    """One method's measurements, per prompt (so ratios get paired intervals over prompts)."""

    tokens: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    accepted: int = 0
    speculative_rounds: int = 0
    draft_forward_passes: int = 0
    drafted: int = 0  # draft tokens the verifier was sent
    own_tokens: int = 0  # a drafter of another tokenizer: tokens it drafted in its own
    reencode_rollbacks: int = 0
    mapping_ms: float = 0.0
    drafter_failures: int = 0  # failed Draft calls: those rounds went on with the verifier alone
    wire_ms: float = 0.0
    total_ms: float = 0.0
    rounds: int = 0
    bytes_per_round: list[float] = field(default_factory=list)
    first_token_ms: list[float] = field(default_factory=list)  # per request through the services
    plan_rounds: Counter = field(default_factory=Counter)  # rounds per plan (the adaptive row's choices)
    outputs: list[list[int]] = field(default_factory=list)
    # Structured outputs (prompts with a schema): forced tokens drafted and accepted, the
    # verifier's masking and the coordinator's share, and the answers that validate.
    forced: int = 0
    accepted_forced: int = 0
    grammar_mask_ms: float = 0.0
    grammar_draft_ms: float = 0.0
    valid: list[bool] = field(default_factory=list)
    speculative_anatomy: AnatomyTally = field(default_factory=AnatomyTally)
    verifier_alone_anatomy: AnatomyTally = field(default_factory=AnatomyTally)

    def add(self, token_ids: list[int], seconds: float) -> None:
        self.tokens.append(len(token_ids))
        self.seconds.append(seconds)
        self.outputs.append(list(token_ids))

    def add_llama_cpp(self, run: LlamaCppRun, tokenizer, max_new_tokens: int) -> None:
        """Its text in the verifier's tokens (llama.cpp stops at end-of-generation without printing
        it). Speculative decoding may overshoot the limit by a round: the tokens past it are cut,
        their share of the time with them."""
        tokens = tokenizer(run.text, add_special_tokens=False)["input_ids"]
        kept = tokens[:max_new_tokens]
        self.add(kept, run.seconds * len(kept) / max(len(tokens), 1))
        self.drafted += run.drafted
        self.accepted += run.accepted

    def add_service(self, response, seconds: float) -> None:
        stats = response.stats
        self.add(response.token_ids, seconds)
        self.accepted += stats.accepted_draft_tokens
        self.speculative_rounds += stats.speculative_rounds
        self.draft_forward_passes += stats.draft_forward_passes
        self.drafted += stats.drafted_tokens
        self.own_tokens += stats.draft_own_tokens
        self.reencode_rollbacks += stats.draft_reencode_rollbacks
        self.mapping_ms += stats.draft_mapping_ms
        self.drafter_failures += stats.drafter_failures
        self.rounds += stats.rounds
        self.wire_ms += stats.wire_serialization_ms
        self.total_ms += stats.total_ms
        self.bytes_per_round.append(stats.bytes_per_round)
        self.first_token_ms.append(stats.first_token_ms)
        self.plan_rounds.update(stats.plan_rounds)
        self.speculative_anatomy.add(stats.speculative_anatomy)
        self.verifier_alone_anatomy.add(stats.verifier_alone_anatomy)
        self.forced += stats.forced_tokens
        self.accepted_forced += stats.accepted_forced_tokens
        self.grammar_mask_ms += stats.grammar_mask_ms
        self.grammar_draft_ms += stats.grammar_draft_ms

    def add_validity(self, text: str, schema: dict) -> None:
        """Whether the answer parses as JSON and follows `schema`."""
        import jsonschema

        try:
            jsonschema.validate(json.loads(text), schema)
            self.valid.append(True)
        except (ValueError, jsonschema.ValidationError):
            self.valid.append(False)

    def structured(self) -> dict | None:
        """The structured-output columns of a row whose prompts carried a schema (None otherwise)."""
        if not self.valid:
            return None
        return {
            "valid_share": sum(self.valid) / len(self.valid),
            "forced_share_of_drafted": self.forced / self.drafted if self.drafted else None,
            "forced_share_of_accepted": self.accepted_forced / self.accepted if self.accepted else None,
            "grammar_mask_share": self.grammar_mask_ms / self.total_ms if self.total_ms else None,
            "grammar_coordinator_share": self.grammar_draft_ms / self.total_ms if self.total_ms else None,
        }

    def round_anatomy(self) -> dict | None:
        """Per kind of round, the means of its parts; None for a method outside the services."""
        kinds = {"speculative": self.speculative_anatomy.row(), "verifier_alone": self.verifier_alone_anatomy.row()}
        return kinds if any(kinds.values()) else None

    @property
    def tokens_per_second(self) -> float:
        return sum(self.tokens) / sum(self.seconds) if sum(self.seconds) else 0.0

    def ratio_to(self, other: "Tally") -> dict:
        """tokens/s over the other's, with its paired 95% interval over prompts."""
        low, high = paired_ratio_interval((self.tokens, self.seconds), (other.tokens, other.seconds))
        return {"ratio": self.tokens_per_second / other.tokens_per_second, "ci95": [low, high]}


def run_speed(args, setup: BenchSetup) -> int:
    from specdec.core.models import eos_token_ids, load_model, weight_format_of
    from specdec.serving.client import CoordinatorClient, generate_request, server_token
    from specdec.app.launch import start_beside, stop_stack
    from specdec.serving.wire import shape_to_proto

    config, app_args, tokenizer, prompts, prompt_ids = setup.config, setup.app_args, setup.tokenizer, setup.prompts, setup.prompt_ids
    temperatures, budgets, trees, shapes, placements = setup.temperatures, setup.budgets, setup.trees, setup.shapes, setup.placements
    entries = args.drafters.split(",") if args.drafters else [config.drafter.model.source]
    sources = list(dict.fromkeys(entry.split(":")[0] for entry in entries))
    formats = args.verifier_formats.split(",") if args.verifier_formats else [config.verifier.model.dtype]
    # dtype auto: the format it chooses on this machine, served by the stacks and named in the rows
    formats = list(dict.fromkeys(weight_format_of(dataclasses.replace(config.verifier.model, dtype=f)) for f in formats))
    # A stack variant: where the verifier runs and its weight format; rows of several are named VARIANT/NAME.
    variants = [(placement, dtype) for placement in placements for dtype in formats]
    if args.address and (len(sources) > 1 or ORACLE in sources or len(variants) > 1):
        raise SystemExit(
            "--drafters with several drafters, the oracle, several --placements or --verifier-formats start their own stacks; "
            "leave out --address"
        )
    # The oracle's reference table: empty while the stacks start, then recorded through them.
    references = Path(args.out).resolve().with_name(Path(args.out).stem + "_oracle")
    if ORACLE in sources:
        write_references(references, [])
    # How often each stack's drafter sees a prompt (the first stack also serves the verifier alone).
    runs_per_prompt = {
        source: len(temperatures) * (
            len(trees) * len(budgets) * sum(e.split(":")[0] == source for e in entries) + (source == sources[0]) * (1 + args.adaptive)
        )
        for source in sources
    }
    clients = {}
    for j, (variant, source) in enumerate((v, s) for v in variants for s in sources):  # one stack each, side by side
        # No prefix cache: every method decodes each prompt once, and a verifier that kept the
        # prompt's keys and values would prefill it only for the method that ran first.
        placement, dtype = variant
        stack_args = {
            **app_args, "coordinator": {"port": args.port + j, "verifier_in_process": placement == COLOCATED},
            "drafter": _drafter_args(source, config, runs_per_prompt[source] == 1, references, tokenizer),
            "verifier": {"prefix_cache_mib": 0, "model": {**dataclasses.asdict(config.verifier.model), "dtype": dtype}},
        }
        address = args.address or start_beside(stack_args, args.port + j, j)
        clients[variant, source] = CoordinatorClient(address, server_token(config))
    served, verifier, drafter, verifier_fp32, assistant = config.verifier.model, None, None, None, None
    if args.in_process:
        verifier = load_model(served)
        assistant = args.hf_assistant or _hf_assistant(config.drafter.model.source)
        drafter = load_model(dataclasses.replace(config.drafter.model, source=assistant))
        verifier_fp32 = verifier if served.dtype == "float32" else load_model(dataclasses.replace(served, dtype="float32"))

    def through_services(
        i: int, budget: int | None, temperature: float, shape: TreeShape | None = None, entry: str | None = None, adaptive: bool = False,
        max_new_tokens: int = args.max_new_tokens, variant: tuple[str, str] = variants[0], constrained: bool = True,
    ):
        source, _, option = (entry or sources[0]).partition(":")
        request = generate_request(
            prompt_token_ids=prompt_ids[i],
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=args.seed + i,
            num_draft_tokens=budget,
            tree=shape_to_proto(shape) if shape else None,
            adaptive=adaptive,
            **({"steering": False} if option == "unsteered" else {}),
        )
        if constrained and "schema" in prompts[i]:  # --prompts json: the answer follows its schema
            request.constraint.json_schema = json.dumps(prompts[i]["schema"])
        start = time.perf_counter()
        response = clients[variant, source].generate(request)
        return response, time.perf_counter() - start

    def in_process(i: int, model, assisted: bool, temperature: float, prompt_lookup: bool = False):
        torch.manual_seed(args.seed + i)
        inputs = torch.tensor([prompt_ids[i]])
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {"do_sample": False}
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                inputs,
                attention_mask=torch.ones_like(inputs),
                max_new_tokens=args.max_new_tokens,
                assistant_model=drafter if assisted else None,
                **({"prompt_lookup_num_tokens": HF_PROMPT_LOOKUP_TOKENS} if prompt_lookup else {}),
                pad_token_id=tokenizer.eos_token_id,
                **sampling,
            )
        return out[0, inputs.shape[1] :].tolist(), time.perf_counter() - start

    # (name, variant, method, drafter, tree, budget, runner(prompt index, temperature) -> service response or token ids, seconds)
    methods = []
    for variant in variants:
        prefix = "/".join(part for part, several in zip(variant, (len(placements) > 1, len(formats) > 1)) if several)
        named = (lambda name, prefix=prefix: f"{prefix}/{name}") if prefix else (lambda name: name)
        methods.append((named("autoregressive"), variant, "autoregressive", None, None, 0,
                        lambda i, t, v=variant: through_services(i, 0, t, variant=v)))
        if any("schema" in p for p in prompts):  # what the constraint costs the verifier alone
            methods.append((named("autoregressive_unconstrained"), variant, "autoregressive_unconstrained", None, None, 0,
                            lambda i, t, v=variant: through_services(i, 0, t, variant=v, constrained=False)))
        methods += [
            (
                named(f"{entry}:{tree}_b{b}" if len(entries) > 1 else f"{tree}_b{b}"), variant, "speculative", entry, tree, b,
                lambda i, t, b=b, tree=tree, entry=entry, v=variant: through_services(i, b, t, shapes[tree], entry, variant=v),
            )
            for entry in entries
            for tree in trees
            for b in budgets
        ]
        if args.adaptive:
            methods.append((named("adaptive"), variant, "adaptive", sources[0], None, None,
                            lambda i, t, v=variant: through_services(i, None, t, adaptive=True, variant=v)))
    if args.in_process and any(is_model_free(s) or s == "hybrid" for s in sources):
        methods.append(("hf_prompt_lookup", None, "hf_prompt_lookup", None, None, None,
                        lambda i, t: in_process(i, verifier, False, t, prompt_lookup=True)))
    gguf = verifier_gguf(served.source)
    if gguf is not None and llama_cpp_installed():  # the CPU anchor: llama.cpp on the same file
        eos = set(eos_token_ids(verifier, tokenizer) if verifier is not None else [tokenizer.eos_token_id])
        for name, lookup in (("llama_cpp", False), ("llama_cpp_prompt_lookup", True)):
            decoder = LlamaCppDecoder(gguf, torch.get_num_threads(), eos, prompt_lookup=lookup)
            methods.append((name, None, name, None, None, None,
                            lambda i, t, d=decoder: d.generate(prompt_ids[i], args.max_new_tokens, t, args.seed + i)))
    if args.llama_cpp:  # llama-speculative-simple on the same file: plain, with a draft model, with its n-gram drafting
        if gguf is None:
            raise SystemExit(f"--llama-cpp needs a verifier from a GGUF file; {served.source} is not one")
        prompt_texts = [tokenizer.decode(ids, skip_special_tokens=False) for ids in prompt_ids]
        draft_gguf = verifier_gguf(args.llama_cpp_draft) if args.llama_cpp_draft else None
        for mode in map(LlamaCppMode.parse, args.llama_cpp.split(",")):
            binary = LlamaCppBinary(gguf, mode, torch.get_num_threads(), draft_gguf)

            def run(i: int, t: float, binary=binary) -> tuple[LlamaCppRun, float]:
                answer = binary.generate(prompt_texts[i], args.max_new_tokens, t, args.seed + i)
                return answer, answer.seconds
            methods.append((mode.name, None, "llama_cpp_binary", args.llama_cpp_draft if mode.needs_draft_model else None, None,
                            mode.draft_max or None, run))
    methods += [
        ("hf_assisted", None, "hf_assisted", assistant, None, None, lambda i, t: in_process(i, verifier, True, t)),
        ("hf_generate", None, "hf_generate", None, None, None, lambda i, t: in_process(i, verifier, False, t)),
        ("hf_generate_fp32", None, "hf_generate_fp32", None, None, None, lambda i, t: in_process(i, verifier_fp32, False, t)),
    ] if args.in_process else []
    results = []
    try:
        if ORACLE in sources:  # the verifier alone's greedy continuations, through the first stack, untimed
            write_references(references, [(prompt_ids[i], list(through_services(i, 0, 0.0)[0].token_ids)) for i in range(len(prompt_ids))])
        for temperature in temperatures:
            for warm in clients.values():
                warm.generate(generate_request(prompt="Hi", max_new_tokens=4, temperature=temperature))
            for variant in variants if args.adaptive else ():  # untimed, as in the RTT sweep: the controller measures every plan first
                through_services(
                    len(prompt_ids) - 1, None, temperature, adaptive=True, max_new_tokens=4 * args.max_new_tokens, variant=variant
                )
            tallies = {name: Tally() for name, *_ in methods}
            # Interleaved: every prompt visits every method in turn, so drift hits all alike.
            for i in tqdm(range(len(prompt_ids)), desc=f"T={temperature}", unit="prompt"):
                for name, *_, runner in turn_order(methods, i):
                    answer, seconds = runner(i, temperature)
                    if isinstance(answer, list):
                        tallies[name].add(answer, seconds)
                    elif isinstance(answer, LlamaCppRun):
                        tallies[name].add_llama_cpp(answer, tokenizer, args.max_new_tokens)
                    else:
                        tallies[name].add_service(answer, seconds)
                        if "schema" in prompts[i] and not name.endswith("autoregressive_unconstrained"):
                            tallies[name].add_validity(answer.text, prompts[i]["schema"])
            alone_in = {variant: tallies[name] for name, variant, method, *_ in methods if method == "autoregressive"}
            for name, variant, method, drafter_name, tree, budget, _ in methods:
                tally, alone = tallies[name], alone_in[variant or variants[0]]
                row = {
                    "name": name,
                    "placement": variant and variant[0],
                    "verifier_dtype": variant and variant[1],
                    "drafter": drafter_name,
                    "method": method,
                    "tree": tree,
                    "budget": budget,
                    "temperature": temperature,
                    "tokens_per_second": tally.tokens_per_second,
                    "mean_accepted_per_round": tally.accepted / tally.speculative_rounds if tally.speculative_rounds else None,
                    "tokens_per_verify_call": sum(tally.tokens) / tally.rounds if tally.rounds else None,
                    "draft_forwards_per_round": tally.draft_forward_passes / tally.speculative_rounds if tally.speculative_rounds else None,
                    "drafted_per_round": tally.drafted / tally.speculative_rounds if tally.speculative_rounds else None,
                    "draft_acceptance": tally.accepted / tally.drafted if tally.drafted else None,
                    # Drafting across tokenizers: the drafter's own tokens, its re-encoding rollbacks and mapping time per round.
                    "across_tokenizers": {
                        "own_tokens_per_round": tally.own_tokens / tally.speculative_rounds,
                        "rollbacks_per_round": tally.reencode_rollbacks / tally.speculative_rounds,
                        "mapping_ms_per_round": tally.mapping_ms / tally.speculative_rounds,
                    } if tally.own_tokens else None,
                    "drafter_failures": tally.drafter_failures,
                    "vs_autoregressive": tally.ratio_to(alone),
                    "vs_hf_assisted": tally.ratio_to(tallies["hf_assisted"]) if args.in_process else None,
                    "vs_hf_generate_fp32": tally.ratio_to(tallies["hf_generate_fp32"]) if args.in_process else None,
                    "wire_share": tally.wire_ms / tally.total_ms if tally.total_ms else None,
                    "bytes_per_round": sum(tally.bytes_per_round) / len(tally.bytes_per_round) if tally.bytes_per_round else None,
                    "first_token_ms": statistics.median(tally.first_token_ms) if tally.first_token_ms else None,
                    "plan_rounds": tally.plan_rounds or None,
                    "round_anatomy": tally.round_anatomy(),
                    "generated_tokens": sum(tally.tokens),
                    "seconds": sum(tally.seconds),
                    "tokens_per_prompt": tally.tokens,
                    "seconds_per_prompt": tally.seconds,
                    "structured": tally.structured(),
                }
                row["speedup_vs_autoregressive"] = row["vs_autoregressive"]["ratio"]
                row["vs_autoregressive_by_category"] = _ratio_by_category(tally, alone, [p["category"] for p in prompts])
                if temperature == 0:
                    # Exactness is against the served verifier alone; for float32 weights also generate().
                    row["greedy_matches_verifier_alone"] = _share_equal(tally.outputs, alone.outputs)
                    if served.dtype == "float32" and args.in_process:
                        row["greedy_matches_hf_generate"] = _share_equal(tally.outputs, tallies["hf_generate"].outputs)
                if tally.drafter_failures:
                    print(f"warning: {name}: {tally.drafter_failures} Draft calls failed and their rounds went on with "
                          "the verifier alone, so this row does not measure its drafter (see the drafter's log)", file=sys.stderr)
                results.append(row)
    finally:
        for each in clients.values():
            each.close()
        if not args.address:
            stop_stack()
    add_hop_floors(results)  # with the stacks stopped, so they take no CPU from the measurement

    report = {
        "config": {
            "verifier": config.verifier.model.__dict__,
            "drafter": config.drafter.model.__dict__,
            "drafters": entries,
            "placements": placements,
            "verifier_formats": formats,
            "hf_assistant": assistant,
            "prompts": args.prompts,
            "question_ids": setup.question_ids(),
            "categories": sorted({p["category"] for p in prompts}),
            "max_new_tokens": args.max_new_tokens,
            "temperatures": temperatures,
            "budgets": budgets,
            "trees": {method: dataclasses.asdict(shape) for method, shape in shapes.items()},
            "prefix_cache_mib": config.verifier.prefix_cache_mib if args.address else 0,
            "drafter_memory_across_requests": (
                "as served" if args.address else {source: runs == 1 for source, runs in runs_per_prompt.items()}
            ),
            "torch_threads": torch.get_num_threads(),
            "oracle_references": str(references) if ORACLE in sources else None,
        },
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    plot_path = out.with_suffix(".png")
    plot_results(results, plot_path)
    written = [out, plot_path, out.with_name(out.stem + "_anatomy.png")]
    plot_anatomy(results, written[-1])
    if len(budgets) > 1:
        written.append(out.with_name(out.stem + "_trees.png"))
        plot_acceptance_by_budget(results, written[-1])
    print(format_table(results))
    print(format_anatomy(results))
    if len({p["category"] for p in prompts}) > 1:
        print(format_by_category(results))
    if any(r["structured"] for r in results):
        print(format_structured(results))
    print("wrote " + ", ".join(map(str, written)))
    return 0


def _ratio_by_category(tally: Tally, alone: Tally, categories: list[str]) -> dict[str, float]:
    """tokens/s over the verifier alone's, within each category's prompts."""
    ratios = {}
    for category in dict.fromkeys(categories):
        mine = [i for i, c in enumerate(categories) if c == category]
        rate = sum(tally.tokens[i] for i in mine) / sum(tally.seconds[i] for i in mine)
        ratios[category] = rate / (sum(alone.tokens[i] for i in mine) / sum(alone.seconds[i] for i in mine))
    return ratios


def format_by_category(results: list[dict]) -> str:
    categories = sorted(results[0]["vs_autoregressive_by_category"])
    lines = ["| method | T | " + " | ".join(categories) + " |", "|---|---|" + "---|" * len(categories)]
    for r in results:
        by = r["vs_autoregressive_by_category"]
        lines.append(f"| {r['name']} | {r['temperature']:g} | " + " | ".join(f"{by[c]:.2f}x" for c in categories) + " |")
    return "\n".join(lines)


def _drafter_args(entry: str, config, sees_each_prompt_once: bool, references: Path, verifier_tokenizer) -> dict:
    """The drafter section of the stack that benchmarks one --drafters entry (the oracle's
    source: its reference table in `references`; NAME@OPTION@...: NAME with a draft vocabulary
    of N for an OPTION that is a number, in the weight format an OPTION names otherwise)."""
    entry, *options = entry.split("@")
    own = entry in ("model", "hybrid", "fallback", "staged")
    # Memory across requests only where the drafter decodes each prompt once: it then learns
    # from the other prompts, as in service; one that remembered a prompt's earlier run would
    # draft its next run from it.
    memory = {} if sees_each_prompt_once else {"recent_output_tokens": 0}
    from specdec.core.models import ModelSpec

    named_model = not own and entry != ORACLE and not is_model_free(entry)
    # A drafter model named on the command line: int8 (it reads any weights), on both cores
    # while it drafts (the config's one thread suits only a tiny drafter beside the verifier).
    # Another drafter than the config's takes none of its model's settings (a draft vocabulary, say):
    # every field is named, so that none comes from the config file the stack's args merge into.
    model = dataclasses.asdict(config.drafter.model if own else ModelSpec(
        str(references) if entry == ORACLE else entry, **({"dtype": "int8"} if named_model else {})
    ))
    for option in options:  # a block format from a file stored otherwise: quantized again
        model |= {"draft_vocab": int(option)} if option.isdigit() else {"dtype": option, "requantize": option in BLOCK_FORMATS}
    return {
        "model": model,
        **({"torch_threads": 0} if named_model else {}),
        "ngram": {
            "method": (config.drafter.ngram.method or "suffix") if entry in ("hybrid", "fallback") else "",
            "fallback": entry == "fallback", **memory,
        },
        "staged_lookahead": (config.drafter.staged_lookahead or STAGED_LOOKAHEAD) if entry == "staged" else 0,
        "tokenizer": config.drafter.tokenizer if own else _tokenizer_of(entry, verifier_tokenizer),
    }


def _tokenizer_of(drafter: str, verifier_tokenizer) -> str:
    """A named drafter model drafts in its own tokens where its tokenizer is not the verifier's."""
    from specdec.core.feature_head import is_feature_head
    from specdec.core.models import load_tokenizer, tokenizer_fingerprint

    if is_model_free(drafter) or drafter == ORACLE or is_feature_head(drafter):
        return "shared"
    return "shared" if tokenizer_fingerprint(load_tokenizer(drafter)) == tokenizer_fingerprint(verifier_tokenizer) else "own"


def _hf_assistant(drafter: str) -> str:
    """transformers runs causal LMs only: a feature head's place goes to the built-in distilled drafter."""
    from specdec.core.feature_head import is_feature_head
    from specdec.core.hub import BUILTIN_DRAFTER

    return BUILTIN_DRAFTER if is_feature_head(drafter) else drafter


def _share_equal(outputs: list[list[int]], reference: list[list[int]]) -> float:
    return sum(a == b for a, b in zip(outputs, reference)) / len(reference)


def format_table(results: list[dict]) -> str:
    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    lines = [
        (
            "| name | drafter | tree | budget | T | tokens/s | vs autoregressive [95% CI] | vs hf_assisted | vs hf_generate_fp32 | "
            "accepted/round | tokens/verify call | draft forwards/round | bytes/round | wire share | first token ms | "
            "greedy = verifier alone |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['name']} | {r.get('drafter') or '-'} | {r.get('tree') or '-'} | {fmt(r['budget'], 'd')} | {r['temperature']:g} | "
            f"{r['tokens_per_second']:.2f} | "
            f"{_ratio(r['vs_autoregressive'])} | {_ratio(r['vs_hf_assisted'])} | {_ratio(r['vs_hf_generate_fp32'])} | "
            f"{fmt(r['mean_accepted_per_round'], '.2f')} | {fmt(r['tokens_per_verify_call'], '.2f')} | "
            f"{fmt(r.get('draft_forwards_per_round'), '.2f')} | {fmt(r['bytes_per_round'], '.0f')} | "
            f"{fmt(r['wire_share'], '.1%')} | {fmt(r.get('first_token_ms'), '.0f')} | "
            f"{fmt(r.get('greedy_matches_verifier_alone'), '.0%')} |"
        )
    return "\n".join(lines)


def format_structured(results: list[dict]) -> str:
    """The structured-output columns: answers that validate, forced tokens, the grammar's cost."""
    def share(value):
        return "-" if value is None else f"{value:.1%}"

    lines = ["| name | valid | forced / drafted | forced / accepted | mask share | coordinator share |", "|---|---|---|---|---|---|"]
    for r in results:
        s = r["structured"]
        if s:
            lines.append(
                f"| {r['name']} | {share(s['valid_share'])} | {share(s['forced_share_of_drafted'])} | "
                f"{share(s['forced_share_of_accepted'])} | {share(s['grammar_mask_share'])} | {share(s['grammar_coordinator_share'])} |"
            )
    return "\n".join(lines)


def add_hop_floors(results: list[dict]) -> None:
    """Sets each hop's floor in the rows' round anatomy: a bare loopback gRPC call carrying the
    hop's median payload after the rest of the round's time without a call (gRPC's threads
    sleep meanwhile); none for a verifier in the coordinator's process."""
    kinds = [(r, kind) for r in results for kind in (r["round_anatomy"] or {}).values() if kind is not None]
    for r, kind, hop in ((r, kind, hop) for r, kind in kinds for hop in HOPS):
        payload = kind[f"{hop}_payload_bytes"]
        if payload is None or (hop == "verify" and r.get("placement") == COLOCATED):  # an in-process call has no wire
            kind[f"{hop}_hop_floor_ms"] = None
            continue
        idle_ms = min(max(kind["round_ms"] - kind[f"{hop}_hop_ms"], 0.0), IDLE_CAP_MS)  # the rest of the round
        kind[f"{hop}_hop_floor_ms"] = loopback_call_ms(*payload, idle_ms=idle_ms)


def _anatomy_rows(results: list[dict]):
    """(row, kind of round, its anatomy) for each row through the services: its speculative
    rounds where it has them, else its verifier-alone rounds."""
    for r in results:
        kinds = r["round_anatomy"] or {}
        kind = "speculative" if kinds.get("speculative") else "verifier_alone"
        if kinds.get(kind):
            yield r, kind, kinds[kind]


def format_anatomy(results: list[dict]) -> str:
    """Means per round, ms: each hop with its loopback floor in brackets and, after a slash, its
    part inside the service outside compute."""
    def hop(a: dict, name: str) -> str:
        floor = a[f"{name}_hop_floor_ms"]
        return f"{a[f'{name}_hop_ms']:.2f}" + (f" [{floor:.2f}]" if floor is not None else "") + f" / {a[f'{name}_in_service_ms']:.2f}"

    lines = [
        (
            "| name | drafter | tree | budget | T | rounds of | rounds | round | draft compute | verify compute | "
            "draft hop [floor] / in service | verify hop [floor] / in service | coordinator | overhead (share) |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r, kind, a in _anatomy_rows(results):
        lines.append(
            f"| {r['name']} | {r.get('drafter') or '-'} | {r.get('tree') or '-'} | {'-' if r['budget'] is None else r['budget']} | "
            f"{r['temperature']:g} | "
            f"{kind.replace('_', ' ')} | {a['rounds']} | {a['round_ms']:.2f} | {a['draft_compute_ms']:.2f} | "
            f"{a['verify_compute_ms']:.2f} | "
            f"{hop(a, 'draft')} | {hop(a, 'verify')} | {a['coordinator_ms']:.2f} | {a['overhead_ms']:.2f} "
            f"({a['overhead_ms'] / a['round_ms']:.0%}) |"
        )
    return "\n".join(lines)


def _ratio(ratio: dict | None) -> str:
    if ratio is None:
        return "-"
    low, high = ratio["ci95"]
    return f"{ratio['ratio']:.2f}x [{low:.2f}, {high:.2f}]"


def _panels_by_temperature(results: list[dict], width: float, height: float):
    """A figure with one panel per temperature (matplotlib, headless): (figure, [(axes, temperature)])."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = sorted({r["temperature"] for r in results})
    fig, axes = plt.subplots(1, len(temperatures), figsize=(width * len(temperatures), height), squeeze=False)
    return fig, list(zip(axes[0], temperatures))


def _save(fig, title: str, path: Path) -> None:
    import textwrap

    import matplotlib.pyplot as plt

    fig.suptitle(textwrap.fill(title, int(fig.get_figwidth() * 11)))  # about the characters a line of the figure holds
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_results(results: list[dict], path: Path) -> None:
    most = max(Counter(r["temperature"] for r in results).values())
    fig, panels = _panels_by_temperature(results, max(6.0, 0.9 * most), 4)
    for ax, temperature in panels:
        rows = [r for r in results if r["temperature"] == temperature]
        ax.bar([r["name"] for r in rows], [r["tokens_per_second"] for r in rows], color="tab:blue")
        for i, r in enumerate(rows):
            ax.text(i, r["tokens_per_second"], f"{r['speedup_vs_autoregressive']:.2f}x", ha="center", va="bottom")
        ax.set_title(f"T = {temperature:g}")
        ax.set_ylabel("tokens / s")
        ax.set_xticks(range(len(rows)), [r["name"] for r in rows], rotation=30, ha="right")
    _save(fig, "specdec bench: tokens/s (label: speedup vs verifier-only through the services)", path)


def plot_anatomy(results: list[dict], path: Path) -> None:
    """Each row's mean round, part by part, as a stacked bar; a tick marks each hop's floor."""
    parts = [("draft_compute_ms", "draft compute"), ("verify_compute_ms", "verify compute"), ("draft_hop_ms", "draft hop"),
             ("verify_hop_ms", "verify hop"), ("coordinator_ms", "coordinator")]
    fig, panels = _panels_by_temperature(results, 7, 4.5)
    for ax, temperature in panels:
        rows = [(r, kind, a) for r, kind, a in _anatomy_rows(results) if r["temperature"] == temperature]
        labels = [r["name"] + (" (per call)" if kind == "verifier_alone" else "") for r, kind, _ in rows]
        left = [0.0] * len(rows)
        for (key, label), color in zip(parts, ("tab:blue", "tab:orange", "tab:green", "tab:olive", "tab:red")):
            # Timing noise can make the coordinator's remainder a hair below zero: drawn as none.
            widths = [max(a[key], 0.0) for _, _, a in rows]
            ax.barh(labels, widths, left=left, color=color, label=label)
            if key.endswith("hop_ms"):
                floors = [(i, a[key.replace("_ms", "_floor_ms")]) for i, (_, _, a) in enumerate(rows)]
                ax.scatter(
                    [left[i] + f for i, f in floors if f is not None], [i for i, f in floors if f is not None],
                    marker="|", color="black", s=120,
                )
            left = [x + w for x, w in zip(left, widths)]
        ax.set_title(f"T = {temperature:g}")
        ax.set_xlabel("ms per round (|: the hop's bare loopback gRPC call)")
        ax.invert_yaxis()
        ax.legend(fontsize="small")
    _save(fig, "specdec bench: round anatomy, ms per speculative round (verifier alone: per call)", path)


def plot_acceptance_by_budget(results: list[dict], path: Path) -> None:
    """Accepted draft tokens per verifier call against the node budget, one line per tree method."""
    fig, panels = _panels_by_temperature(results, 6, 4)
    for ax, temperature in panels:
        rows = [r for r in results if r["temperature"] == temperature and r["method"] == "speculative"]
        for tree in dict.fromkeys(r["tree"] for r in rows):
            line = sorted((r["budget"], r["mean_accepted_per_round"]) for r in rows if r["tree"] == tree)
            ax.plot([b for b, _ in line], [a for _, a in line], marker="o", label=tree)
        ax.set_xscale("log", base=2)
        ax.set_title(f"T = {temperature:g}")
        ax.set_xlabel("draft tree nodes per round (budget)")
        ax.set_ylabel("accepted draft tokens per verifier call")
        ax.legend()
    _save(fig, "specdec bench: acceptance by tree method and budget", path)
