"""The MTP block's draft vocabulary: its LM head over the first N token ids only.

Why: an MTP draft runs the block (one decoder layer) and then an LM head as large as the trunk's.
In a small model with a large vocabulary that head is a large part of a token's cost (Qwen3.5-0.8B:
151,936 x 1,024 of 674M weights, 7-9 ms of a 35-40 ms decoding step here), so each chained draft
costs a fifth of a token and MTP at depth 3 gains far less than the accepted tokens promise. FR-Spec
(Zhao et al., 2025) and EAGLE-3 draft over a frequent subset of the vocabulary instead; the
target still verifies every draft over its whole vocabulary, so the output does not change (greedy
tokens are the same, and sampling stays exact: a draft's distribution is the softmax over the
subset, zero elsewhere, which speculative sampling's acceptance rule takes as it is).

Which subset: byte-level BPE vocabularies (Qwen's, Kimi's tiktoken) number their tokens in merge
order, and merges were learnt most frequent first, so the first N ids are a frequency-ranked
subset without a corpus, and a view of the head's first N rows (no copy, no memory). Measured with
Qwen's 151,643-token vocabulary (tests' vocab file): the first 32,768 ids hold 91.6% of the tokens
of this project's English docs and 92.3% of its Python sources (65,536: 97.1% / 97.6%). A token
past the subset is never drafted: that position's draft is rejected, as a wrong draft is.

When: where the head is a large share of a token's weight reads (`head_share`). Its rows then
cost N / n_vocab of the head's, and a subset loses the draft positions whose token lies past it
(about 8% of them in the text above), so it pays where the head is at least MIN_HEAD_SHARE of the
bytes a token reads: the bench files at Qwen3.5-0.8B's shapes with the 151,936-token vocabulary
have 19% (Q8_0) and 22% (Q4_K_M); a 27B-sized model's head is a few percent of its weights and
keeps the whole vocabulary. In a MoE model a token reads only its chosen experts, so those count
at n_expert_used / n_expert.
"""

from __future__ import annotations

from typing import Mapping

from deltarun.base.errors import DeltarunError
from deltarun.base.gguf_file import TensorInfo
from deltarun.base.interface import HParams

#: rows of the draft head when chosen automatically
DEFAULT_DRAFT_VOCAB = 32768
#: the head's share of a token's weight bytes from which the automatic choice drafts over a subset
MIN_HEAD_SHARE = 0.10


def head_share(hp: HParams, tensors: Mapping[str, TensorInfo], head: str) -> float:
    """Bytes of weight `head` over the bytes one token's trunk evaluation reads: every matrix, the
    routed experts' at n_expert_used / n_expert (a token reads its chosen experts only); the token
    embeddings count one row, as a lookup reads one."""
    total = 0.0
    for name, info in tensors.items():
        if name == "token_embd.weight" and name != head:
            total += info.nbytes / max(1, info.ne[-1])
        elif "_exps." in name and hp.n_expert:
            total += info.nbytes * hp.n_expert_used / hp.n_expert
        else:
            total += info.nbytes
    if head == "token_embd.weight":          # tied: the LM head reads the whole table
        total += tensors[head].nbytes
    return tensors[head].nbytes / total if total else 0.0


def resolve_draft_vocab(requested: int | None, hp: HParams, tensors: Mapping[str, TensorInfo], head: str) -> int:
    """The draft head's rows: 0 for the whole vocabulary. `requested` None chooses (see the module
    docstring); 0 or n_vocab and above keep the whole vocabulary; else those first ids."""
    if requested is None:
        if hp.n_vocab <= 2 * DEFAULT_DRAFT_VOCAB or head_share(hp, tensors, head) < MIN_HEAD_SHARE:
            return 0
        return DEFAULT_DRAFT_VOCAB
    if requested < 0:
        raise DeltarunError(f"--draft-vocab must be 0 (the whole vocabulary) or a number of token ids (got {requested})")
    return 0 if requested >= hp.n_vocab else requested
