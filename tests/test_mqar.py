"""The MQAR experiment (attnbook.experiments.mqar): its batches, and one tiny
configuration of its training run for each kind of layer."""

import pytest
import torch

from attnbook.experiments.mqar import mqar_batch, train_mqar


def test_batches_pair_each_query_with_its_value():
    g = torch.Generator().manual_seed(0)
    ids, targets, queries = mqar_batch(5, 20, 3, g)
    assert ids.shape == targets.shape == queries.shape == (3, 15)
    for row, target in zip(ids, targets):
        keys, values = row[0:10:2], row[1:10:2]
        assert len(set(keys.tolist())) == 5 and int(keys.max()) < 10
        assert int(values.min()) >= 10
        lookup = dict(zip(keys.tolist(), values.tolist()))
        for t in range(10, 15):
            assert target[t] == lookup[int(row[t])]
        assert (target[:10] == -100).all()
    with pytest.raises(ValueError, match="distinct keys"):
        mqar_batch(11, 20, 1, g)


@pytest.mark.parametrize(
    "layers", [("attention",), ("delta",), ("gated_delta", "attention")]
)
def test_one_tiny_configuration_trains(layers, one_torch_thread):
    accuracy = train_mqar(
        layers, n_pairs=4, seed=0, steps=3, batch=4, vocab_size=16, d_model=16
    )
    assert 0.0 <= accuracy <= 1.0
