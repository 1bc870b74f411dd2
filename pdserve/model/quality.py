"""How much a weight format changes the model: teacher-force a fixed text through it and
compare with the float32 model, position by position.

The text is CPython's own reference documentation of special method names
(`pydoc_data.topics`, shipped with every Python): natural English prose, fixed per Python
version, available offline. `top1_agreement` is the share of positions whose greedy token is
the same; `perplexity` is exp(mean negative log-likelihood of the text's next tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.model.attention import AttentionMetadata, allocate_kv_cache
from pdserve.model.loader import LoadedModel

NUM_TOKENS = 2048
CHUNK_TOKENS = 512
BLOCK_SIZE = 16


def reference_text() -> str:
    import pydoc_data.topics

    return pydoc_data.topics.topics["specialnames"]


def reference_token_ids(loaded: LoadedModel, num_tokens: int = NUM_TOKENS) -> list[int]:
    ids = loaded.tokenizer.encode(reference_text())
    if len(ids) < num_tokens:
        raise ValueError(f"the reference text has {len(ids)} tokens, fewer than {num_tokens}")
    return ids[:num_tokens]


@dataclass(frozen=True)
class TeacherForced:
    """Per position i (predicting token i + 1): the greedy token and the text's NLL."""

    greedy: torch.Tensor  # [N - 1] int64
    nll: torch.Tensor  # [N - 1] float32

    @property
    def perplexity(self) -> float:
        return float(torch.exp(self.nll.mean()))

    def top1_agreement(self, reference: TeacherForced) -> float:
        return float((self.greedy == reference.greedy).float().mean())


@torch.inference_mode()
def teacher_force(loaded: LoadedModel, ids: list[int]) -> TeacherForced:
    """Prefill `ids` in chunks through a paged cache (as the engine does) and score every
    next token; only the greedy tokens and NLLs are kept (not [N, vocab] logits)."""
    model, n = loaded.model, len(ids)
    num_blocks = -(-n // BLOCK_SIZE)
    cache = allocate_kv_cache(loaded.config, num_blocks, BLOCK_SIZE, loaded.dtype, loaded.device)
    table = list(range(num_blocks))
    tokens = torch.tensor(ids, device=loaded.device)
    greedy, nll = [], []
    for start in range(0, n - 1, CHUNK_TOKENS):
        end = min(start + CHUNK_TOKENS, n - 1)
        meta = AttentionMetadata.build([(table, start, end - start)], BLOCK_SIZE, loaded.device)
        hidden = model(
            tokens[start:end], torch.arange(start, end, device=loaded.device), cache, meta
        )
        logits = model.compute_logits(hidden)
        greedy.append(logits.argmax(-1).cpu())
        nll.append(F.cross_entropy(logits, tokens[start + 1 : end + 1], reduction="none").cpu())
    return TeacherForced(torch.cat(greedy), torch.cat(nll))
