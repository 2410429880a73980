import torch
import torch.nn.functional as F

from spmd_engine.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from spmd_engine.models.parallel import TensorParallel

VOCAB, HIDDEN = 11, 4
FULL = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0))


def test_vocab_padded_to_multiple_of_tp_with_zero_rows():
    shards = []
    for rank in range(2):
        emb = VocabParallelEmbedding(VOCAB, HIDDEN, TensorParallel(rank, 2))
        emb.weight.weight_loader(emb.weight, FULL)
        assert (emb.padded_vocab_size, emb.rows_per_rank) == (12, 6)
        shards.append(emb.weight.data)
    torch.testing.assert_close(torch.cat(shards)[:VOCAB], FULL)
    assert torch.count_nonzero(shards[1][-1]) == 0


def test_single_rank_lookup_and_logits():
    emb = VocabParallelEmbedding(VOCAB, HIDDEN, TensorParallel.single())
    emb.weight.weight_loader(emb.weight, FULL)
    ids = torch.tensor([0, 10, 3, 3])
    torch.testing.assert_close(emb(ids), F.embedding(ids, FULL))
    head = ParallelLMHead(VOCAB, HIDDEN, TensorParallel.single())
    head.weight.weight_loader(head.weight, FULL * 2)
    hidden = torch.randn(3, HIDDEN).to(torch.bfloat16)
    head.to(torch.bfloat16)
    logits = head.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (3, VOCAB)
    torch.testing.assert_close(logits, F.linear(hidden, (FULL * 2).to(torch.bfloat16)).float())


def test_tied_head_shares_the_embedding_parameter():
    emb = VocabParallelEmbedding(VOCAB, HIDDEN, TensorParallel(1, 2))
    head = ParallelLMHead(VOCAB, HIDDEN, TensorParallel(1, 2), tied_to=emb)
    assert head.weight is emb.weight
