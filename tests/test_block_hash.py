"""Chained block hash keys, and the modules that must import without torch."""

import subprocess
import sys

import pytest

from rtp_serve.core.block_hash import block_hash_keys, hash_block, salt_of

BS = 4


def test_keys_are_chained_block_by_block():
    tokens = list(range(10))
    keys = block_hash_keys(tokens, BS)
    assert keys == [
        hash_block(None, [0, 1, 2, 3]),
        hash_block(keys[0], [4, 5, 6, 7]),
    ]
    assert all(len(k) == 16 for k in keys)


def test_equal_prefixes_give_equal_keys():
    a = block_hash_keys([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], BS)
    b = block_hash_keys([1, 2, 3, 4, 5, 6, 7, 8, 90, 10, 11, 12], BS)
    assert a[:2] == b[:2]
    assert a[2] != b[2]


def test_change_in_block0_changes_every_later_key():
    a = block_hash_keys(list(range(16)), BS)
    b = block_hash_keys([99] + list(range(1, 16)), BS)
    assert len(a) == len(b) == 4
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_equal_blocks_after_different_prefixes_get_different_keys():
    # Block 1 holds the same tokens in both, but the prefix differs: keys name prefixes.
    a = block_hash_keys([1, 1, 1, 1, 5, 6, 7, 8], BS)
    b = block_hash_keys([2, 2, 2, 2, 5, 6, 7, 8], BS)
    assert a[1] != b[1]


def test_different_extra_gives_disjoint_keys():
    tokens = list(range(12))
    extras = [
        b"",
        salt_of("llama", "bfloat16"),
        salt_of("llama", "float16"),
        salt_of("llama", "bfloat16", adapter="lora-a"),
        salt_of("qwen", "bfloat16"),
    ]
    key_sets = [set(block_hash_keys(tokens, BS, extra)) for extra in extras]
    assert all(len(s) == 3 for s in key_sets)
    union = set().union(*key_sets)
    assert len(union) == 3 * len(extras)


def test_salt_of_is_deterministic():
    assert salt_of("m", "bfloat16") == salt_of("m", "bfloat16")
    assert len(salt_of("m", "bfloat16")) == 16


@pytest.mark.parametrize(
    ("num_tokens", "num_keys"), [(0, 0), (3, 0), (4, 1), (7, 1), (8, 2), (11, 2)]
)
def test_only_full_blocks_are_hashed(num_tokens, num_keys):
    assert len(block_hash_keys(list(range(num_tokens)), BS)) == num_keys


def test_incremental_extension_equals_full_recompute():
    tokens = list(range(100, 123))  # 5 full blocks and a partial one
    full = block_hash_keys(tokens, BS, b"x")
    head = block_hash_keys(tokens[:9], BS, b"x")  # 2 keys; token 8 is in a partial block
    assert head == full[:2]
    tail = block_hash_keys(tokens, BS, b"x", parent=head[-1], start=len(head) * BS)
    assert head + tail == full


def test_extension_with_nothing_new_is_empty():
    tokens = list(range(8))
    keys = block_hash_keys(tokens, BS)
    assert block_hash_keys(tokens + [8, 9], BS, parent=keys[-1], start=8) == []


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="block_size"):
        block_hash_keys([1, 2], 0)
    with pytest.raises(ValueError, match="start"):
        block_hash_keys(list(range(8)), BS, start=2)


@pytest.mark.parametrize(
    "module",
    [
        "rtp_serve.core.block_hash",
        "rtp_serve.core.tokenizer",
        "rtp_serve.core.sampling_params",
    ],
)
def test_module_imports_without_torch(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch was imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_cache_salt_names_the_model_by_content_not_path(model_dir, tmp_path):
    import shutil

    from rtp_serve.core.block_hash import cache_salt

    src = model_dir("tiny-llama")
    copy = shutil.copytree(src, tmp_path / "mounted" / "elsewhere")
    salt = cache_salt(src, "float32")
    assert cache_salt(copy, "float32") == salt  # the same model at two paths
    assert cache_salt(copy, "bfloat16") != salt  # another KV dtype
    assert cache_salt(copy, "float32", adapter="lora-a") != salt
    assert cache_salt(model_dir("tiny-qwen2"), "float32") != salt  # another model

    # Same config and tensor index, other weights (a fine-tune moves every weight a little):
    # another salt.
    weights = next(copy.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    for i in range(header, len(data), 4):  # the low byte of every float32
        data[i] ^= 1
    weights.write_bytes(bytes(data))
    assert cache_salt(copy, "float32") != salt


def test_verify_first_key_catches_another_salt():
    from rtp_serve.core.block_hash import verify_first_key

    tokens = list(range(10))
    keys = block_hash_keys(tokens, BS, b"a")
    assert verify_first_key(keys, tokens, BS, b"a")
    assert not verify_first_key(keys, tokens, BS, b"b")
    assert not verify_first_key(keys[:1], tokens, BS, b"a")  # wrong count
