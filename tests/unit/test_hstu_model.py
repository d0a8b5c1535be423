"""The HSTU layers and model: shapes, causality (a token never sees later tokens nor other users),
the jagged layers equal a per-user reference written here from the paper's equations, the
objectives' losses and the evaluation's ranks."""

import pytest
import torch
import torch.nn.functional as F

from apps.core.common.errors import ConfigError
from apps.hstu.config import HSTUModelConfig, train_config
from apps.hstu.data.batch import SequenceBatch
from apps.hstu.model import TABLES_PATH, build_model, table_configs
from apps.hstu.modules.attention import attention_kernel, padded_attention
from apps.hstu.modules.jagged import JaggedLayout
from apps.hstu.modules.layer import HSTULayer, time_bucket

# Tier (tests/conftest.py): pure logic, fast.
TIER = "unit"

CPU = torch.device("cpu")
SMALL = dict(num_items=50, num_actions=3, embedding_dim=16, num_heads=2, attention_dim=8, linear_dim=4, max_seq_len=8)


def layer(seed: int = 0) -> HSTULayer:
    torch.manual_seed(seed)
    built = HSTULayer(16, 2, 8, 4, max_seq_len=8, num_time_buckets=6, dropout=0.0, attention=padded_attention)
    with torch.no_grad():  # biases away from their zero start, so that the test sees them
        built.bias.position.normal_()
        built.bias.time.normal_()
    return built


def jagged_inputs(lengths: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, JaggedLayout]:
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    x = torch.randn(total, 16, generator=generator)
    gaps = torch.randint(0, 5000, (total,), generator=generator)
    layout = JaggedLayout.of(torch.tensor(lengths))
    # times grow within each user: cumulative gaps from the user's first event
    starts = torch.repeat_interleave(
        torch.cumsum(gaps, 0)[layout.offsets[:-1]] - gaps[layout.offsets[:-1]], layout.lengths
    )
    return x, torch.cumsum(gaps, 0) - starts, layout


def reference_layer(built: HSTULayer, x: torch.Tensor, times: torch.Tensor) -> torch.Tensor:
    """One user's tokens [n, d] through the layer, by the paper's equations, token by token."""
    h, dl, da = built.num_heads, built.linear_dim, built.attention_dim
    projected = F.silu(built.uvqk(built.input_norm(x)))
    u, v, q, k = torch.split(projected, [h * dl, h * dl, h * da, h * da], dim=-1)
    out = torch.zeros(x.shape[0], h * dl)
    for i in range(x.shape[0]):
        for head in range(h):
            qs, ks = q[:, head * da : (head + 1) * da], k[:, head * da : (head + 1) * da]
            vs = v[:, head * dl : (head + 1) * dl]
            for j in range(i + 1):
                bias = built.bias.position[i - j] + built.bias.time[time_bucket(times[i] - times[j], 6)]
                weight = F.silu(qs[i] @ ks[j] + bias) / 8
                out[i, head * dl : (head + 1) * dl] += weight * vs[j]
    return x + built.output(built.attention_norm(out) * u)


def test_layer_keeps_the_shape_of_its_tokens():
    x, times, layout = jagged_inputs([3, 1, 5])
    assert layer()(x, times, layout).shape == (9, 16)


def test_jagged_layer_equals_the_per_user_reference():
    built = layer()
    lengths = [3, 1, 5, 2]
    x, times, layout = jagged_inputs(lengths)
    out = built(x, times, layout)
    for user, (start, end) in enumerate(zip(layout.offsets[:-1].tolist(), layout.offsets[1:].tolist())):
        expected = reference_layer(built, x[start:end], times[start:end])
        torch.testing.assert_close(out[start:end], expected, rtol=1e-5, atol=1e-5, msg=f"user {user}")


def test_a_token_depends_on_neither_later_tokens_nor_other_users():
    built = layer()
    x, times, layout = jagged_inputs([4, 6, 3])
    out = built(x, times, layout)
    changed = x.clone()
    changed[4 + 3] += 10.0  # user 1's fourth token
    times_changed = times.clone()
    times_changed[4 + 5] += 10**6  # and user 1's last event's time
    out_changed = built(changed, times_changed, layout)
    torch.testing.assert_close(out_changed[:4], out[:4])  # user 0
    torch.testing.assert_close(out_changed[4:7], out[4:7])  # user 1, earlier tokens
    torch.testing.assert_close(out_changed[10:], out[10:])  # user 2
    assert not torch.allclose(out_changed[7:10], out[7:10])  # the changed token and those after it


def test_time_buckets_are_logarithmic_and_capped():
    seconds = torch.tensor([0, 1, 2, 3, 4, 1000, 10**12])
    assert time_bucket(seconds, 12).tolist() == [0, 1, 1, 2, 2, 9, 11]


def batch(lengths: list[int], negatives: int, seed: int = 2, num_items: int = 50) -> SequenceBatch:
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    return SequenceBatch.of(
        items=torch.randint(0, num_items, (total,), generator=generator),
        actions=torch.randint(0, 3, (total,), generator=generator),
        timestamps=torch.arange(total) * 60,
        lengths=torch.tensor(lengths),
        negatives=torch.randint(0, num_items, (len(lengths), negatives), generator=generator),
    )


def model(**options):
    torch.manual_seed(0)
    return build_model(HSTUModelConfig(**{**SMALL, **options}), CPU, CPU)


@pytest.mark.parametrize("objective", ["retrieval", "ranking"])
def test_the_loss_trains_every_parameter(objective):
    train = model(objective=objective)
    loss, (detached,) = train(batch([4, 2, 6], negatives=5))
    assert loss.ndim == 0 and torch.isfinite(loss) and detached.requires_grad is False
    loss.backward()
    missing = [name for name, p in train.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == [], missing


def test_tables_are_where_the_sharding_plan_looks_and_on_the_meta_device_by_default():
    train = build_model(HSTUModelConfig(**SMALL), CPU)
    tables = train.get_submodule(TABLES_PATH)
    assert [c.name for c in table_configs(train.cfg)] == ["item_table", "action_table"]
    assert all(p.is_meta for p in tables.parameters())
    assert not any(p.is_meta for name, p in train.named_parameters() if not name.startswith(TABLES_PATH))


def brute_force_ranks(train, b: SequenceBatch) -> torch.Tensor:
    """The target's rank among all items, each user's query against every item row."""
    encoded = train.model.encode(b)
    last = encoded.layout.last_index()
    queries = F.normalize(encoded.outputs[last - 1], dim=-1)
    table = F.normalize(train.get_submodule(TABLES_PATH).embeddings["item_table"].weight, dim=-1)
    scores = queries @ table.T
    targets = encoded.items[last][:, None]
    higher = (scores > scores.gather(1, targets)).scatter(1, targets, False)  # the target is no rival
    return higher.sum(1) + 1


def test_evaluation_ranks_the_target_among_all_items_in_chunks():
    train = model().eval()
    b = batch([3, 5, 2, 7], negatives=0)
    expected = brute_force_ranks(train, b)
    for chunk in (7, 50, 1000):
        assert train.evaluate(b, chunk_items=chunk).ranks.tolist() == expected.tolist()


def test_evaluation_ranks_the_target_among_its_sampled_negatives():
    train = model().eval()
    b = batch([3, 5], negatives=4)
    ranks = train.evaluate(b).ranks
    encoded = train.model.encode(b)
    last = encoded.layout.last_index()
    queries = F.normalize(encoded.outputs[last - 1], dim=-1)
    table = F.normalize(train.get_submodule(TABLES_PATH).embeddings["item_table"].weight, dim=-1)
    negatives = b.features["negative_item"].values().view(2, 4)
    for user in range(2):
        target = queries[user] @ table[encoded.items[last[user]]]
        assert ranks[user] == 1 + int((table[negatives[user]] @ queries[user] > target).sum())


def test_ranking_evaluation_gives_the_target_events_action_logits_and_labels():
    train = model(objective="ranking").eval()
    b = batch([3, 5], negatives=0)
    out = train.evaluate(b)
    actions = b.features["action"].values()
    assert out.action_logits.shape == (2, 3)
    assert out.action_labels.argmax(1).tolist() == [actions[2].item(), actions[7].item()]


def test_the_fused_kernel_is_refused_in_one_line_where_it_cannot_run():
    if torch.cuda.is_available():
        pytest.skip("checks the refusal on a machine without CUDA")
    with pytest.raises(ConfigError, match="^--attention_kernel fused needs a CUDA GPU") as refused:
        attention_kernel("fused")
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("sharding_type", ["table_row_wise", "data_parallel"])
def test_a_sharding_type_torchrec_cannot_run_on_the_tables_is_refused_in_one_line(sharding_type):
    with pytest.raises(
        ConfigError, match=f"^--sharding_type {sharding_type} cannot shard the HSTU's tables"
    ) as refused:
        train_config(sharding_type=sharding_type)
    assert "\n" not in str(refused.value)
    assert "give auto, table_wise, row_wise or column_wise" in str(refused.value)


@pytest.mark.gpu
def test_the_fused_kernel_equals_the_pytorch_kernel():
    pytest.importorskip("hstu", reason="FBGEMM's HSTU kernel (fbgemm_gpu/experimental/hstu) is not installed")
    if not torch.cuda.is_available():
        pytest.skip("FBGEMM's HSTU kernel is CUDA only")
    x, times, layout = jagged_inputs([3, 1, 5])
    q, k, v = (t.cuda().bfloat16() for t in (x[:, :8], x[:, 8:], x[:, 4:12]))
    q, k, v = (t.reshape(-1, 2, 4) for t in (q, k, v))
    layout = JaggedLayout.of(layout.lengths.cuda())
    bias = torch.randn(3, 5, 5, device="cuda", dtype=torch.bfloat16)
    expected = padded_attention(q.float(), k.float(), v.float(), bias.float(), layout, 1 / 8)
    torch.testing.assert_close(
        attention_kernel("fused")(q, k, v, bias, layout, 1 / 8).float(), expected, rtol=2e-2, atol=2e-2
    )
