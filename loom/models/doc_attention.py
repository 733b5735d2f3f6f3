"""Document-aware causal attention without a dense mask (packed sequences: SFT packing, `data.document_mask`).

Packed rows carry `doc_ids` (the document of every position); a query attends only to earlier keys of its own
document. The dense path (`loom.models.llama.attention_core`) builds that as a boolean [b, 1, s_q, s_k] mask
and hands it to SDPA, which on a GPU rules out the flash kernel (an explicit mask sends SDPA to its
memory-efficient or math kernel) and costs s_q x s_k bytes per row and layer.

`flex_document_attention` states the same rule as a FlexAttention `mask_mod` instead; `create_block_mask`
turns it into a block-sparse mask (blocks of 128 x 128 positions: wholly visible, partly visible, or skipped),
and FlexAttention's generated kernel never computes a skipped block: the work follows the documents'
lengths, not the row's. It runs where it pays: on a GPU inside a compiled region (`wanted`), where
torch.compile generates the kernel; eager FlexAttention is a reference implementation, far slower than SDPA.
Context parallelism's chunks (queries at the last s_q of s_k key positions) are the same rule with an offset.
"""

from __future__ import annotations

import torch

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # torch without FlexAttention: the dense path only
    create_block_mask = flex_attention = None


def wanted(q: torch.Tensor, dropout: float) -> bool:
    """Whether document-masked attention should run through FlexAttention: on a GPU, inside torch.compile
    (where its kernel is generated), without attention dropout (FlexAttention has none)."""
    return (flex_attention is not None and q.is_cuda and dropout == 0.0
            and torch.compiler.is_compiling())


def flex_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            doc_ids: torch.Tensor) -> torch.Tensor:
    """Causal attention within documents. q [b, hq, s_q, d]; k, v [b, hkv, s_k, d] (hq a multiple of hkv);
    queries sit at the last s_q of the s_k key positions; `doc_ids` [b, >= s_k] the document of each key
    position (queries take theirs from the same row). Equal to `attention_core` with `doc_ids`."""
    b, hq, s_q, _ = q.shape
    s_k = k.shape[2]
    offset = s_k - s_q
    docs = doc_ids[:, :s_k]

    def same_document_causal(bi, h, qi, ki):
        return (ki <= qi + offset) & (docs[bi, ki] == docs[bi, qi + offset])

    block = create_block_mask(same_document_causal, b, None, s_q, s_k, device=q.device)
    return flex_attention(q, k, v, block_mask=block, enable_gqa=hq != k.shape[1])
