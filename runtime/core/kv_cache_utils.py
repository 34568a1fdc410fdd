"""KV cache blocks, the free-block LRU list and chained block hashing.

Ported in behaviour from vLLM V1 `vllm/v1/core/kv_cache_utils.py`
(`KVCacheBlock`, `FreeKVCacheBlockQueue`, `hash_block_tokens`,
`get_request_block_hasher`, `make_block_hash_with_group_id`).

Hashing is chained: the hash of block i covers the hash of block i-1, so one hash
names a whole prefix. Unlike vLLM, the seed (`NONE_HASH`) is a fixed constant and
the encoding is explicit bytes fed to sha256, so hashes are equal across
processes, runs and PYTHONHASHSEED values.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NewType

if TYPE_CHECKING:
    from kiln.runtime.core.request import Request

# A block's chained hash (32 bytes of sha256).
BlockHash = NewType("BlockHash", bytes)
# A block hash with the KV cache group id appended as 4 big-endian bytes, so the
# same tokens cached by two groups (attention and GDN state) are two entries.
BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)

# The parent hash of the first block of every sequence.
NONE_HASH = BlockHash(hashlib.sha256(b"kiln.kv_cache_utils.NONE_HASH.v1").digest())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    return BlockHashWithGroupId(block_hash + group_id.to_bytes(4, "big", signed=False))


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    return BlockHash(key[:-4])


def get_group_id(key: BlockHashWithGroupId) -> int:
    return int.from_bytes(key[-4:], "big", signed=False)


def _encode_extra_key(key: Any) -> bytes:
    """A stable, type-tagged byte encoding of one extra key (no pickle, no hash())."""
    if key is None:
        return b"N"
    if isinstance(key, bool):
        return b"B1" if key else b"B0"
    if isinstance(key, int):
        s = str(key).encode()
        return b"I" + struct.pack("<I", len(s)) + s
    if isinstance(key, str):
        s = key.encode("utf-8")
        return b"S" + struct.pack("<I", len(s)) + s
    if isinstance(key, (bytes, bytearray)):
        return b"Y" + struct.pack("<I", len(key)) + bytes(key)
    if isinstance(key, (tuple, list)):
        return b"T" + struct.pack("<I", len(key)) + b"".join(_encode_extra_key(k) for k in key)
    raise TypeError(f"unsupported extra key type for block hashing: {type(key).__name__}")


def hash_block_tokens(parent_block_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: tuple[Any, ...] | None = None) -> BlockHash:
    """sha256(parent hash || token ids as int64 LE || extra keys).

    `parent_block_hash` None means the first block (NONE_HASH is used)."""
    return _hash_block_bytes(parent_block_hash, struct.pack(f"<{len(token_ids)}q", *token_ids), extra_keys)


def _hash_block_bytes(parent_block_hash: BlockHash | None, token_bytes: bytes | memoryview,
                      extra_keys: tuple[Any, ...] | None) -> BlockHash:
    """hash_block_tokens on the token ids already packed as int64 LE."""
    h = hashlib.sha256(parent_block_hash if parent_block_hash is not None else NONE_HASH)
    h.update(token_bytes)
    if extra_keys:
        h.update(_encode_extra_key(tuple(extra_keys)))
    return BlockHash(h.digest())


def get_request_block_hasher(block_size: int) -> Callable[[Request], list[BlockHash]]:
    """-> a function giving the hashes of a request's full blocks not hashed yet.

    vLLM: `get_request_block_hasher`. The request's `cache_salt` (if any) enters
    the first block's extra keys, so salted requests never share a prefix with
    unsalted ones (nor with other salts)."""

    def request_block_hasher(request: Request) -> list[BlockHash]:
        start = len(request.block_hashes) * block_size
        num_tokens = request.num_tokens
        if start + block_size > num_tokens:
            return []
        prev = request.block_hashes[-1] if request.block_hashes else None
        tokens = request.all_token_ids
        salt = getattr(request, "cache_salt", None)
        new_hashes: list[BlockHash] = []
        n = (num_tokens - start) // block_size * block_size
        # every new full block's ids packed in one call (a 2,048-token prompt: one pack, not 128)
        packed = memoryview(struct.pack(f"<{n}q", *tokens[start:start + n]))
        step = 8 * block_size
        first = 0
        if start == 0 and salt:  # the salt enters the first block's extra keys
            prev = _hash_block_bytes(prev, packed[:step], (salt,))
            new_hashes.append(prev)
            first = step
        sha256 = hashlib.sha256
        for off in range(first, 8 * n, step):  # _hash_block_bytes without extra keys, inlined
            h = sha256(prev if prev is not None else NONE_HASH)
            h.update(packed[off:off + step])
            prev = BlockHash(h.digest())
            new_hashes.append(prev)
        return new_hashes

    request_block_hasher.block_size = block_size  # type: ignore[attr-defined]  # Request skips calls before a block fills
    return request_block_hasher


class KVCacheBlock:
    """One KV cache block: its id, how many requests use it, and, once full and
    cached, its hash. `prev_free_block`/`next_free_block` link it into the free
    queue while ref_cnt is 0 (intrusive list: O(1) removal from the middle)."""

    __slots__ = ("_block_hash", "block_id", "is_null", "next_free_block", "prev_free_block", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self._block_hash: BlockHashWithGroupId | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        # The null block (id 0) is never allocated; it pads block tables.
        self.is_null = False

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: BlockHashWithGroupId) -> None:
        assert self._block_hash is None, "the block already has a hash"
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        self._block_hash = None

    def __repr__(self) -> str:
        h = self._block_hash.hex()[:8] if self._block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks in eviction order (LRU first).

    A freed block goes to the tail; allocation pops from the head, so the least
    recently freed block is evicted first. A block touched by a prefix-cache hit
    is removed from the middle in O(1). Two sentinel nodes avoid None checks."""

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self._tail
        self._tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("no free blocks available")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks: only {self.num_free_blocks} are free")
        out: list[KVCacheBlock] = []
        curr = self._head.next_free_block
        for _ in range(n):
            assert curr is not None and curr is not self._tail
            out.append(curr)
            nxt = curr.next_free_block
            curr.prev_free_block = curr.next_free_block = None
            curr = nxt
        self._head.next_free_block = curr
        assert curr is not None
        curr.prev_free_block = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"remove() called on a block not in the free queue: {block}")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """append() of each block in order, as one splice (a finished prompt frees 128 blocks)."""
        tail = self._tail
        last = tail.prev_free_block
        assert last is not None
        n = 0
        for block in blocks:
            last.next_free_block = block
            block.prev_free_block = last
            last = block
            n += 1
        last.next_free_block = tail
        tail.prev_free_block = last
        self.num_free_blocks += n

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks head to tail (for tests and debugging)."""
        out = []
        curr = self._head.next_free_block
        while curr is not None and curr is not self._tail:
            out.append(curr)
            curr = curr.next_free_block
        return out
