""" "Found in the Middle" attention calibration (arXiv 2406.16008): the last query re-weighted over documents."""

import dataclasses
from dataclasses import dataclass, field

import torch

from .cache_sepformer import MitigationState, SepFormerCache
from .mitigation_base import (
    AttentionFunction,
    CallContext,
    LayerRun,
    Mitigation,
    MitigationPlan,
    QueryKeyProjection,
    attention_implementation,
    last_logits,
    last_row_output,
    last_row_scores,
    refuse_under_compile,
    replaced,
)
from .mitigation_options import AttentionCalibration
from .spans import (
    check_default_positions,
    check_dummy_document,
    check_spans_in_prompt,
    default_dummy_token,
    dummy_batch,
    key_documents,
    key_positions,
)


@dataclass(frozen=True, eq=False)
class KeyDocuments:
    """Which document each prompt key lies in, for one run of the layers, with the sums every calibrated layer needs.
    Keys past the prompt's (the generated tokens') lie in no document."""

    membership: torch.Tensor  # (b, P, K) one-hot over the P prompt keys, all zero outside documents (float32: rows of
    # probabilities)
    sizes: torch.Tensor  # (b, 1, K) keys per document
    outside: torch.Tensor  # (b, 1, P): 1 for prompt keys in no document
    keys: int  # the run's keys, P and those after them
    # Made once with the membership, not at every decoding step of every layer:
    divisors: torch.Tensor  # (b, 1, K) the sizes, 1 for a document a crop removed whole (no keys)
    by_document: torch.Tensor  # (b, K, P) the membership transposed (a view)

    @classmethod
    def of(cls, membership: torch.Tensor) -> "KeyDocuments":
        sizes = membership.sum(1)[:, None]
        outside = 1 - membership.sum(-1)[:, None]
        return cls(membership, sizes, outside, membership.shape[1], sizes.clamp(min=1), membership.mT)

    def held(self, keys: int) -> "KeyDocuments":
        """The documents of the last `keys` keys, those a sliding-window cache holds; `sizes` stay the whole
        documents': a token slid out of the window gets no attention, as in a pass over every key."""
        dropped = self.keys - keys
        if not dropped:  # every key held: a decoding step of a full-attention layer
            return self
        return replaced(
            self,
            membership=self.membership[:, dropped:],
            outside=self.outside[..., dropped:],
            by_document=self.by_document[..., dropped:],
            keys=keys,
        )


def calibrate_row(
    probs: torch.Tensor, documents: KeyDocuments, bias: torch.Tensor, temperature: float, in_place: bool = False
) -> torch.Tensor:
    """Re-weight one attention row `probs` (b, H, kv) over `K` documents, with `bias` (b, H, K) the attention a dummy
    document gets at slot `k` (docs/design.md, "Attention calibration"); keys past `documents.membership` lie in none.
    `in_place`: re-weight `probs` itself where it has such keys (a row of the caller's own, without autograd)."""
    prompt = documents.membership.shape[1]
    row = probs[..., :prompt]  # the keys in documents or before them; the rest are untouched
    mass = torch.bmm(row, documents.membership)  # (b, H, K): attention on each document
    mean = mass / documents.divisors  # Attn(doc_k); 0 for a document a crop removed whole (no keys)
    alpha = ((mean - bias) / temperature).softmax(-1)
    keep_total = mass.sum(-1, keepdim=True) / (alpha * documents.sizes).sum(-1, keepdim=True)  # C
    # A document the row does not attend (or a NaN one) gets factor 0; dividing by 1 there keeps its gradient 0.
    unattended = ~(mean > 0)
    factor = (alpha * keep_total / mean.masked_fill(unattended, 1.0)).masked_fill(unattended, 0.0)  # (b, H, K)
    multiplier = torch.bmm(factor, documents.by_document) + documents.outside  # (b, H, P)
    if prompt == probs.shape[-1]:
        return row * multiplier
    if not in_place:
        return torch.cat((row * multiplier, probs[..., prompt:]), -1)
    row.mul_(multiplier)  # the prompt keys' entries of `probs`; the generated keys' stay as they are
    return probs


def bias_from_positions(scores: torch.Tensor, dummy_scores: torch.Tensor, documents: KeyDocuments) -> torch.Tensor:
    """(b, H, K) `bias(k)` without dummy passes: the mean attention on document `k` if its keys alone were the dummy's.

    `scores` (b, H, kv) the last query's logits, -inf where it may not attend, `dummy_scores` the same against the dummy
    keys: `bias(k) = (Σ_{j∈k} D_j / |k|) / (Σ_{j∉k} E_j + Σ_{j∈k} D_j)` with `E`, `D` their exponentials
    (docs/design.md), computed in log space so that a peaked row neither cancels nor overflows.
    """
    in_document = documents.by_document[:, None].bool()  # (b, 1, K, kv)
    dummy_on_k = dummy_scores[:, :, None].masked_fill(~in_document, float("-inf")).logsumexp(-1)  # (b, H, K)
    rest = scores[:, :, None].masked_fill(in_document, float("-inf")).logsumexp(-1)  # (b, H, K): every key but k's
    return (dummy_on_k - torch.logaddexp(rest, dummy_on_k)).exp() / documents.sizes


@dataclass(eq=False)
class CalibrationState(MitigationState):
    """What calibration keeps on the cache from prefill: `bias(k)` and the prompt keys' documents (`KeyDocuments`'
    tensors: a decoding step's key lies in none)."""

    spans: torch.Tensor  # (b, K, 2), counted from each row's first real token
    bias: dict[int, torch.Tensor] = field(default_factory=dict)  # per calibrated layer, (b, H, K)
    documents: KeyDocuments | None = None  # the prompt keys'

    def map_rows(self, function) -> None:
        super().map_rows(function)
        if self.documents is not None:  # each row's, made again from its membership
            self.documents = KeyDocuments.of(function(self.documents.membership))


@dataclass(frozen=True, eq=False)
class CalibrationProbe(Mitigation):
    """Measures `bias(k)` in a dummy pass: records the last query's mean attention on the dummy's keys, changes
    nothing."""

    options_class = AttentionCalibration
    reads_grouped_keys = True
    probe: torch.Tensor | None = None  # (b, kv) boolean: the dummy document's keys
    probed: dict[int, torch.Tensor] = field(default_factory=dict)  # per layer, (b, H)

    def wrap_attention(self, layer_idx: int, function: AttentionFunction, projection) -> AttentionFunction:
        def probing(module, query, key, value, attention_mask, scaling, **kwargs):
            output = function(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
            probs = last_row_scores(query, key, attention_mask, scaling).softmax(-1)  # (b, H, kv)
            probe = self.probe[:, None].to(probs.dtype)  # (b, 1, kv)
            self.probed[layer_idx] = (probs * probe).sum(-1) / probe.sum(-1)
            return output

        return probing


@dataclass(frozen=True, eq=False)
class CalibrationMitigation(Mitigation):
    """In its layers, the attention row of each call's last query (the last prompt token at prefill, then each
    decoding step's token) is re-weighted over the documents, with `bias(k)` measured once at prefill. A call that
    continues a cache takes one token, and the prompt is padded on the left (its last token in the last column);
    `generate` refuses assisted decoding, which drafts tokens after the prompt."""

    options_class = AttentionCalibration
    prefill_requirement = (
        "attention_calibration measures bias(k) on the prompt: it must be on from the first (prefill) call."
    )
    reads_grouped_keys = True  # a decoding step's row is written out against the cache's keys and values as they are
    cache: SepFormerCache | None = None  # keeps `bias(k)` and the spans (a `CalibrationState`)
    returns_weights: bool = False  # the layers' attention gives its weights (eager), so a decoding step gives its row
    documents: KeyDocuments | None = None  # each key's document, for one run

    @classmethod
    def acts_on_last_rows(cls, options: AttentionCalibration) -> bool:
        return True  # the prefill's last row is calibrated

    @classmethod
    def resolve(cls, options: AttentionCalibration, call: CallContext) -> "CalibrationMitigation":
        config = call.model.config
        implementation = attention_implementation(config)
        if implementation == "flex_attention":
            raise ValueError(
                "attention_calibration rewrites the last query's attention row, which flex_attention's block mask "
                "does not give: use attn_implementation 'eager' or 'sdpa'."
            )
        call.positions.check_plain_scores("attention_calibration", "writes the last query's attention row out")
        check_spans_in_prompt(options, call, "spans")
        if call.continuing and call.new_tokens > 1:
            raise ValueError(
                f"attention_calibration calibrates each decoding step's token: a call continuing a cache takes one "
                f"token, and this one has {call.new_tokens}, of which only the last would be calibrated. Feed them "
                "one per call."
            )
        layers = options.layer_set(config.num_hidden_layers)
        if options.bias_estimate == "positional":
            if call.positions.positional_map is None:
                raise ValueError(
                    "attention_calibration bias_estimate='positional' reads the positional block, but "
                    f"{call.positions.no_positional_block}: use bias_estimate='dummy_passes'."
                )
            if not call.continuing:
                return PositionalBiasCalibration(
                    options, layers, call.sepformer_cache, implementation == "eager", position_size=config.position_size
                )
        elif not call.continuing:
            if call.input_ids is None:
                raise ValueError("attention_calibration needs input_ids: its dummy passes splice token ids.")
            check_dummy_document(options, config)
            if options.dummy_document is not None:
                check_default_positions(
                    call,
                    "attention_calibration runs the dummy passes of a dummy_document, each padded anew to its length,",
                )
            if options.dummy_document is not None and call.attention_mask is not None:
                refuse_under_compile(
                    "attention_calibration's dummy_document, of a length of its own, re-pads each dummy pass by its "
                    "row's padding"
                )
        return cls(options, layers, call.sepformer_cache, implementation == "eager")

    def prepare(self, call: CallContext, others) -> None:
        """At prefill, `bias(k)`: one extra pass per (row, document), batched, with the call's other mitigations on."""
        if call.continuing:
            return
        options, config = self.options, call.model.config
        spans = torch.tensor(options.spans, device=call.model.device)
        call.sepformer_cache.mitigation_state[options.name] = CalibrationState(spans)
        if options.bias_estimate == "positional":  # measured in the call's own layers
            return
        ids, padding, probe = dummy_batch(
            options.spans, options.dummy_document, default_dummy_token(config), call.input_ids, call.attention_mask
        )
        rows, documents = len(options.spans), len(options.spans[0])
        # Each row's positions, where the dummy keeps its tokens' places; else the default of each row (`resolve`).
        given = call.position_ids is not None and options.dummy_document is None
        position_ids = call.position_ids.expand(rows, -1).repeat_interleave(documents, 0) if given else None
        # The other mitigations, resolved for the dummy batch with a state of its own (MS-PoE ranks its heads anew).
        dummy_call = dataclasses.replace(
            call,
            input_ids=ids,
            attention_mask=padding,
            position_ids=position_ids,
            cache=None,
            batch=len(ids),
            new_tokens=ids.shape[1],
            sepformer_cache=SepFormerCache(),
        )
        others = tuple(type(other).resolve(other.options, dummy_call) for other in others)
        probing = CalibrationProbe(options, self.layers, probe)
        plan = MitigationPlan.of((*others, probing), config.num_hidden_layers)
        head = last_logits(call.model, 1)  # these passes need their attention, not the causal LM's head
        with torch.no_grad():  # a forward of its own: the caller's output_attentions do not record these passes
            call.model(
                input_ids=ids,
                attention_mask=padding,
                position_ids=position_ids,
                **head,
                **({} if call.extrapolation is None else {"position_extrapolation": call.extrapolation}),
                mitigation_plan=plan,
                use_cache=False,
                output_attentions=False,
                output_hidden_states=False,
            )
        self.state.bias.update(
            {layer: probed.view(rows, documents, -1).transpose(1, 2) for layer, probed in probing.probed.items()}
        )  # (b, H, K)

    @property
    def state(self) -> CalibrationState:
        return self.cache.mitigation_state[self.options.name]

    def start(self, run: LayerRun) -> "CalibrationMitigation":
        kv = run.position_ids.shape[-1] + (run.cache.get_seq_length() if run.cache is not None else 0)
        state = self.state
        if state.documents is None:  # the prefill: each prompt key's document, kept for the decoding steps
            state.documents = KeyDocuments.of(
                key_documents(state.spans, key_positions(run.padding_mask, kv, run.device))
            )
        if kv < state.documents.keys:  # after a crop into the prompt: the documents of the keys left
            return self.replace(documents=KeyDocuments.of(state.documents.membership[:, :kv]))
        return self.replace(documents=replaced(state.documents, keys=kv))  # the prompt's keys, then none (generated)

    def wrap_attention(self, layer_idx: int, function: AttentionFunction, projection) -> AttentionFunction:
        temperature = self.options.temperature

        def calibrated(module, query, key, value, attention_mask, scaling, **kwargs):
            probs = last_row_scores(query, key, attention_mask, scaling).softmax(-1)  # (b, H, kv)
            documents, bias = self.documents.held(key.shape[2]), self.state.bias[layer_idx]
            # a new row under autograd (softmax's backward reads its output), else this one re-weighted in place
            probs = calibrate_row(probs, documents, bias, temperature, in_place=not torch.is_grad_enabled())
            last = last_row_output(probs, value)  # (b, 1, H, d)
            if query.shape[2] == 1:  # a decoding step: its one row is the calibrated row, no other attention to run
                return last, probs[:, :, None].to(query.dtype) if self.returns_weights else None
            output, weights = function(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
            output = torch.cat((output[:, :-1], last), 1)
            if weights is not None:
                weights = torch.cat((weights[:, :, :-1], probs[:, :, None].to(weights.dtype)), 2)
            return output, weights

        return calibrated


@dataclass(frozen=True, eq=False)
class PositionalBiasCalibration(CalibrationMitigation):
    """The prefill of calibration with `bias_estimate="positional"`: each layer measures `bias(k)` on the prompt's own
    pass before calibrating its row (docs/design.md, "Measuring `bias(k)` without dummy passes"). The dummy key's
    semantic block is the documents' mean normed one, not normed again: a mean of unit-scale vectors is shorter."""

    position_size: int = 0
    key_inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # per layer, (b, seq, d_model): what k_proj read

    def query_key_inputs(self, layer_idx, query_input, key_input):
        self.key_inputs[layer_idx] = key_input  # the keys' input, other mitigations' rewrites included
        return query_input, key_input

    def dummy_keys(self, layer_idx: int, projection: QueryKeyProjection) -> torch.Tensor:
        """(b, H, kv, head_dim): the keys of the mean document at every key's position."""
        key_input, d_pos = self.key_inputs.pop(layer_idx), self.position_size
        in_documents = 1 - self.documents.outside.mT  # (b, kv, 1), float32
        semantic = key_input[..., d_pos:]  # (b, kv, d_sem): the normed semantic block, as k_proj reads it
        mean = (semantic.float() * in_documents).sum(1, keepdim=True) / in_documents.sum(1, keepdim=True)
        dummy_input = torch.cat((key_input[..., :d_pos], mean.to(key_input.dtype).expand_as(semantic)), -1)
        return projection.project_keys(dummy_input)

    def wrap_attention(
        self, layer_idx: int, function: AttentionFunction, projection: QueryKeyProjection | None
    ) -> AttentionFunction:
        calibrated = super().wrap_attention(layer_idx, function, projection)

        def measured_then_calibrated(module, query, key, value, attention_mask, scaling, **kwargs):
            with torch.no_grad():  # a measurement, as the dummy passes are: no gradient, no graph kept on the cache
                scores = last_row_scores(query, key, attention_mask, scaling)  # (b, H, kv)
                dummy_key = self.dummy_keys(layer_idx, projection)
                dummy_scores = last_row_scores(query, dummy_key, attention_mask, scaling)
                self.state.bias[layer_idx] = bias_from_positions(scores, dummy_scores, self.documents)
            return calibrated(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

        return measured_then_calibrated
