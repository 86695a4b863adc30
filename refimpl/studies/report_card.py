r"""The MoE report card

A textbook chapter on mixture-of-experts systems ends with a checklist of what
a report on an MoE model must contain:

* total and activated parameters;
* number and size of routed and shared experts;
* top-$k$ and router normalization;
* capacity and overflow policy;
* load-balancing objective or bias;
* expert-parallel topology;
* communication dtype and overlap;
* training token distribution;
* quality, throughput, tail latency and memory.

`report_card()` fills it in for Kimi K3, DeepSeek-V3, DeepSeek-V4 Flash and
Pro, Switch Transformer and the plain LatentMoE layer. Every number that
follows from a configuration is **computed** from the `MoEConfig` preset by
`parameter_counts` and `dispatch_payload`, never typed in; every other entry
names its source; and where the sources say nothing the cell says
**unknown**, with the reason. An empty-looking card is itself a finding: it
shows how much of what the checklist asks the public reports leave out.

Sources: **[K3]** the Kimi K3 technical report, **[chapter]** that textbook
chapter on mixture-of-experts systems (its summary of DeepSeek-V4, and its
checklist), **[V3]** the DeepSeek-V3 technical report and its `config.json`,
**[Switch]** Fedus, Zoph and Shazeer, *Switch Transformers* (JMLR 2022),
**[LatentMoE]** the LatentMoE paper as the K3 report summarizes it,
**[computed]** computed here from the configuration.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import MoEConfig
from ..layer.accounting import dispatch_payload, parameter_counts

__all__ = ["ITEMS", "CardEntry", "report_card", "report_card_entries", "systems"]

#: The checklist of what an MoE report must state, in its order.
ITEMS = (
    "total and activated parameters",
    "routed and shared experts",
    "top-k and router normalization",
    "capacity and overflow policy",
    "load-balancing objective or bias",
    "expert-parallel topology",
    "communication dtype and overlap",
    "training token distribution",
    "quality, throughput, tail latency, memory",
)

#: Bits per MXFP4 weight: a 4-bit E2M1 element plus one 8-bit E8M0 scale per 32.
MXFP4_BITS = 4 + 8 / 32

#: Kimi K3's whole-model totals as its report states them.
K3_TOTAL, K3_ACTIVATED = 2.78e12, 104.2e9


@dataclass(frozen=True)
class CardEntry:
    """One cell: `text`, and whether the sources state it (`known`); an unknown cell's text is the reason."""

    text: str
    known: bool = True

    def markdown(self) -> str:
        """The cell as Markdown: unknown cells in italics, marked as such."""
        return self.text if self.known else f"*unknown: {self.text}*"


def unknown(reason: str) -> CardEntry:
    """A cell the sources do not fill, with the reason."""
    return CardEntry(reason, known=False)


def _giga(x: float) -> str:
    return f"{x / 1e12:.4g} T" if x >= 1e12 else f"{x / 1e9:.4g} B"


def systems() -> dict[str, MoEConfig | None]:
    """The six designs of the card and their configurations (None where no configuration exists)."""
    return {
        "Kimi K3": MoEConfig.k3(),
        "DeepSeek-V3": MoEConfig.deepseek_v3(),
        "DeepSeek-V4 Flash": None,  # its width is not in the sources: no full configuration
        "DeepSeek-V4 Pro": None,
        "Switch Transformer": None,  # a family of models, not one configuration
        "LatentMoE (K3 sizes, no norm)": MoEConfig.k3().replace(use_latent_norm=False),
    }


def _parameters(config: MoEConfig, whole_model: str) -> CardEntry:
    counts = parameter_counts(config)
    return CardEntry(
        f"MoE layers: {_giga(counts['routed_all_layers'])} routed "
        f"({counts['routed_all_layers']:,}), {_giga(counts['activated_all_layers'])} activated per token "
        f"over {config.num_moe_layers} layers [computed]; whole model: {whole_model}")


def _per_width(config: MoEConfig) -> CardEntry:
    """Counts of a plain MoE layer whose width d is unknown: every count is a multiple of d."""
    unit = parameter_counts(config.replace(hidden_size=1, latent_size=1))
    return CardEntry(
        f"per MoE layer, in multiples of the unknown width d: {unit['routed']:,} d routed, "
        f"{unit['activated']:,} d activated per token [computed from the preset]; d, the number of layers "
        "and the totals are not in the sources")


def _experts(config: MoEConfig, where: str) -> CardEntry:
    counts = parameter_counts(config)
    shared = (f"{config.num_shared_experts} shared of width {config.intermediate_size} on d = {config.hidden_size} "
              f"(merged width {config.shared_size})") if config.num_shared_experts else "no shared expert"
    return CardEntry(f"{config.num_experts} routed of {counts['routed_expert']:,} parameters (f = {config.intermediate_size}, "
                     f"input width {config.latent_size}{where}); {shared} [computed]")


def _payload(config: MoEConfig) -> str:
    p = dispatch_payload(config)
    return (f"{p['latent_values']:,} values per token each way (k x {config.latent_size}; "
            f"{p['ratio']:.2f} of a full-width layer's k x d) [computed]")


def _mxfp4_memory(config: MoEConfig) -> str:
    counts = parameter_counts(config)
    per_layer = counts["routed"] * MXFP4_BITS / 8
    return (f"routed experts in MXFP4 ({MXFP4_BITS} bits per weight): {per_layer / 1e9:.1f} GB per layer, "
            f"{per_layer * config.num_moe_layers / 1e12:.2f} TB over {config.num_moe_layers} layers [computed]")


def report_card_entries() -> dict[str, dict[str, CardEntry]]:
    """Every cell of the card: `entries[system][item]`, items as in `ITEMS`."""
    k3 = MoEConfig.k3()
    v3 = MoEConfig.deepseek_v3()
    plain = k3.replace(use_latent_norm=False)
    not_stated = "not stated in the sources this project follows"
    v4_common = {
        "top-k and router normalization": CardEntry(
            "top-6 of sqrt(softplus(z)) + bias (the V3 bias, kept); weight normalization not stated; "
            "first 3 MoE layers choose by a hash of the token id [chapter]"),
        "capacity and overflow policy": unknown(not_stated),
        "load-balancing objective or bias": CardEntry(
            "auxiliary-loss-free bias (V3) plus a very small sequence-wise balance loss; its exact reduction is "
            "not published [chapter]"),
        "expert-parallel topology": CardEntry(
            "no limit on the nodes a token may reach (V3's node limit removed), placement left to a redesigned "
            "parallel system [chapter]; the topology itself is not stated"),
        "communication dtype and overlap": unknown("the chapter refers to MegaMoE's wave dispatch and pull-based "
                                                   "activations but gives no dtype"),
        "training token distribution": unknown(not_stated),
        "quality, throughput, tail latency, memory": unknown(
            "no per-change ablation is reported (the chapter says so); no figures in the sources"),
    }
    return {
        "Kimi K3": {
            ITEMS[0]: _parameters(k3, f"{_giga(K3_TOTAL)} total, {_giga(K3_ACTIVATED)} activated [K3]"),
            ITEMS[1]: _experts(k3, ", the latent"),
            ITEMS[2]: CardEntry(f"top-{k3.k} of sigmoid + bias; weights from the raw scores, renormalized, "
                                f"scaling {k3.routed_scaling_factor} [K3]"),
            ITEMS[3]: unknown("no capacity in the configuration and no overflow policy stated [K3]"),
            ITEMS[4]: CardEntry("Quantile Balancing of the selection bias (Eq. 14), estimated from a "
                                "1000-bin histogram of the global batch (Appendix D); no auxiliary loss stated [K3]"),
            ITEMS[5]: unknown("the report states the all-to-all width, not the parallel layout"),
            ITEMS[6]: CardEntry("dispatch and combine: " + _payload(k3) + "; deployment: routed experts MXFP4, "
                                "activations MXFP8 [K3]; training dtype and overlap not stated"),
            ITEMS[7]: unknown(not_stated),
            ITEMS[8]: CardEntry("memory: " + _mxfp4_memory(k3) + "; quality, throughput and latency not in the "
                                "sources this project follows"),
        },
        "DeepSeek-V3": {
            ITEMS[0]: _parameters(v3, "671 B total, 37 B activated [V3]"),
            ITEMS[1]: _experts(v3, ", the full width"),
            ITEMS[2]: CardEntry(f"top-{v3.k} of sigmoid + bias within the best {v3.topk_group} of {v3.n_group} "
                                f"expert groups (at most 4 nodes); raw scores renormalized, scaling "
                                f"{v3.routed_scaling_factor} [V3]"),
            ITEMS[3]: CardEntry("no token dropping in training or inference [V3]"),
            ITEMS[4]: CardEntry("auxiliary-loss-free bias, sign rule with step 0.001, plus a sequence-wise "
                                "loss at factor 0.0001 [V3]"),
            ITEMS[5]: CardEntry("64-way expert parallelism over 8 nodes; node-limited routing [V3]"),
            ITEMS[6]: CardEntry("dispatch in FP8, combine in BF16; DualPipe overlaps them with computation [V3]; "
                                "dispatch " + _payload(v3)),
            ITEMS[7]: CardEntry("14.8 T tokens of pre-training [V3]"),
            ITEMS[8]: unknown("the report's benchmark tables are outside what this card recomputes"),
        },
        "DeepSeek-V4 Flash": {
            ITEMS[0]: _per_width(MoEConfig.deepseek_v4_flash(hidden_size=1)),
            ITEMS[1]: CardEntry("256 routed of hidden size 2048; 1 shared expert [chapter]"),
            **v4_common,
        },
        "DeepSeek-V4 Pro": {
            ITEMS[0]: _per_width(MoEConfig.deepseek_v4_pro(hidden_size=1)),
            ITEMS[1]: CardEntry("384 routed of hidden size 3072; 1 shared expert [chapter]"),
            **v4_common,
        },
        "Switch Transformer": {
            ITEMS[0]: unknown("a family (Switch-Base to Switch-C); the rule fixes no size"),
            ITEMS[1]: CardEntry("many full-width FFN experts, no shared expert [Switch]"),
            ITEMS[2]: CardEntry("top-1 of a softmax; the token's output is scaled by its gate probability, "
                                "no renormalization [Switch]"),
            ITEMS[3]: CardEntry("capacity C = ceil(c mk/n), c = 1.0 or 1.25 in training; overflowing tokens are "
                                "dropped and pass on the residual connection [Switch]"),
            ITEMS[4]: CardEntry("auxiliary loss n sum f_i P_i at coefficient 0.01 [Switch]"),
            ITEMS[5]: unknown("depends on the model of the family"),
            ITEMS[6]: CardEntry("router computed in float32, dispatch and combine tensors in bfloat16 [Switch]"),
            ITEMS[7]: CardEntry("C4 (Colossal Clean Crawled Corpus) [Switch]"),
            ITEMS[8]: unknown("depends on the model of the family"),
        },
        "LatentMoE (K3 sizes, no norm)": {
            ITEMS[0]: _parameters(plain, "as K3 less the norm gains, by construction"),
            ITEMS[1]: _experts(plain, ", the latent"),
            ITEMS[2]: CardEntry(f"as K3: top-{plain.top_k} of sigmoid + bias, renormalized raw scores [K3]"),
            ITEMS[3]: unknown("the sources do not state one for the original LatentMoE"),
            ITEMS[4]: unknown("the sources do not state the original LatentMoE's balancing"),
            ITEMS[5]: unknown(not_stated),
            ITEMS[6]: CardEntry("dispatch and combine: " + _payload(plain)),
            ITEMS[7]: CardEntry("the original paper's 95 B model: 300 B tokens [LatentMoE]"),
            ITEMS[8]: CardEntry("MMLU-Pro 29.3 to 34.9 at equal activated parameters, 95 B model "
                                "[LatentMoE]; memory: " + _mxfp4_memory(plain)),
        },
    }


def report_card() -> str:
    """The card as a Markdown table: one row per checklist item, one column per design."""
    entries = report_card_entries()
    names = list(entries)
    lines = ["| item | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for item in ITEMS:
        cells = [entries[name][item].markdown().replace("|", "\\|") for name in names]
        lines.append(f"| **{item}** | " + " | ".join(cells) + " |")
    known = sum(e.known for row in entries.values() for e in row.values())
    total = sum(len(row) for row in entries.values())
    lines += ["", f"{known} of {total} cells are stated by a source or computed; {total - known} are unknown."]
    return "\n".join(lines)
