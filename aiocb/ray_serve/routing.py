"""Prefix-affinity routing: a request goes to the replica that already caches its prompt's prefix.

The ingress hashes each prompt in blocks of :data:`BLOCK_CHARS` characters, each hash
chained on the one before, as the paged cache hashes token blocks
(:func:`prefix_hashes`): two prompts share their first ``n`` hashes exactly when they
share their first ``n`` blocks. :class:`PrefixAffinityRouter`, a Ray Serve request router,
remembers which replica each block hash was last sent to, and sends a request to the
replica holding its longest known prefix, unless that replica has more than
``max_imbalance`` ongoing requests beyond the least loaded one. A prompt with no known
prefix goes to the replica holding the fewest known blocks among those not much busier
than the least loaded, so that new prefixes spread evenly over the caches; requests
without a full block go to the less loaded of two random replicas (Ray Serve's default
policy). A
request whose ``x-aiocb-replica`` header names a live replica goes to it (sessions that
stick to one replica, or a look at one replica's ``/metrics``).

Characters stand in for tokens so that the ingress needs no tokenizer: a block of 256
characters is 50 to 80 tokens of English or code, so a shared prefix of a few blocks is
already a few of the cache's pages.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from aiocb.ray_serve.forwarding import ForwardedRequest

#: Characters per hashed block of a prompt.
BLOCK_CHARS = 256
#: Blocks hashed at most per prompt (64 KiB of text): a longer shared prefix routes the same.
MAX_BLOCKS = 256
#: Ongoing requests a prefix's replica may have beyond the least-loaded replica's and still
#: be chosen for it.
MAX_IMBALANCE = 32
#: Block hashes remembered at most (least recently used ones are forgotten).
MAX_ENTRIES = 200_000
#: Routing attempts that offer a prefix's replica alone before others are offered after it:
#: a replica's queue-length probe can miss its 0.1 s deadline on a busy host, and falling
#: back at once would scatter a prefix over the replicas.
AFFINITY_ATTEMPTS = 3


def prompt_text(path: str, body: Any, limit: int = BLOCK_CHARS * MAX_BLOCKS) -> str | None:
    """The text a request's prompt begins with, for prefix hashing (None: no prompt), up to
    about ``limit`` characters (what :func:`prefix_hashes` reads of it: a body of
    megabytes is not made text whole, which held the ingress's loop for a third of a second).

    ``/v1/completions``: the prompt (the first of a list of prompts; token ids as text).
    ``/v1/chat/completions``: the messages, each as its role and content (a message with
    structured content as the canonical JSON of its beginning), which is how the chat
    template lays out the prompt's beginning.
    """
    if not isinstance(body, Mapping):
        return None
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, Sequence) or isinstance(messages, str):
            return None
        texts: list[str] = []
        size = 0
        for message in messages:
            if size >= limit:
                break
            texts.append(_message_text(message, limit - size))
            size += len(texts[-1])
        return "".join(texts)
    if path.endswith("/completions"):
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt[:limit]
        if isinstance(prompt, list):
            head = prompt[: limit // 2 + 1]  # (an id and its comma: two characters or more)
            if all(isinstance(t, int) for t in head):
                return ",".join(map(str, head))
    return None


def _message_text(message: Any, limit: int) -> str:
    if isinstance(message, Mapping) and len(message) == 2:
        role, content = message.get("role"), message.get("content")
        if isinstance(role, str) and isinstance(content, str):  # (anything else walked by its head)
            role = role[:limit]
            return f"\x1e{role}\x1f{content[: limit - len(role)]}"
    head = _head(message, [limit])
    return "\x1e" + json.dumps(head, sort_keys=True, separators=(",", ":"), default=str)


#: Keys of an object beyond which :func:`_head` takes them as they come, unsorted.
_SORTED_KEYS = 64


def _head(value: Any, budget: list[int]) -> Any:
    """``value`` cut to its first characters and items, about ``budget[0]`` of them (spent
    as it goes): what its canonical JSON begins with, made without walking the rest."""
    if isinstance(value, str):
        cut = value[: max(budget[0], 0)]
        budget[0] -= len(cut)
        return cut
    if isinstance(value, Mapping):
        keys = sorted(value, key=str) if len(value) <= _SORTED_KEYS else list(value)
        head: dict[str, Any] = {}
        for key in keys:
            if budget[0] <= 0:
                break
            budget[0] -= len(str(key)) + 1
            head[str(key)] = _head(value[key], budget)
        return head
    if isinstance(value, list | tuple):
        items = []
        for item in value:
            if budget[0] <= 0:
                break
            budget[0] -= 1
            items.append(_head(item, budget))
        return items
    budget[0] -= 8
    return value


def prefix_hashes(text: str, block_chars: int = BLOCK_CHARS, max_blocks: int = MAX_BLOCKS) -> tuple[int, ...]:
    """Chained 64-bit hashes of ``text``'s full blocks of ``block_chars`` characters: the
    ``i``-th hash stands for the first ``i + 1`` blocks."""
    hashes: list[int] = []
    previous = b""
    for start in range(0, min(len(text) // block_chars, max_blocks) * block_chars, block_chars):
        digest = hashlib.blake2b(previous + text[start : start + block_chars].encode(), digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "little"))
        previous = digest
    return tuple(hashes)


class PrefixAffinityRouter(RequestRouter):
    """A Ray Serve request router that sends requests sharing a prompt prefix to one replica.

    Configured with ``RequestRouterConfig(request_router_class=PrefixAffinityRouter,
    request_router_kwargs={"max_imbalance": ..., "max_entries": ...})``; requests carry
    their prefix hashes in :attr:`ForwardedRequest.prefix`. Each handle (each ingress
    replica) keeps its own table.
    """

    def initialize_state(
        self, max_imbalance: int = MAX_IMBALANCE, max_entries: int = MAX_ENTRIES, **unknown: Any
    ) -> None:
        """Set the policy's bounds (Ray Serve calls it with ``request_router_kwargs``)."""
        if unknown:
            raise TypeError(f"PrefixAffinityRouter takes max_imbalance and max_entries, not {', '.join(unknown)}")
        if max_imbalance < 0 or max_entries < 1:
            raise ValueError(f"max_imbalance must be >= 0 and max_entries >= 1, got {max_imbalance}, {max_entries}")
        self.max_imbalance = max_imbalance
        self.max_entries = max_entries
        #: block hash -> the replica the last request with that block went to
        self.owners: OrderedDict[int, ReplicaID] = OrderedDict()
        #: blocks each replica owns in :attr:`owners`
        self.owned: Counter[ReplicaID] = Counter()
        #: routing attempts so far of the requests being routed to their prefix's replica
        self.attempts: OrderedDict[str, int] = OrderedDict()
        #: requests routed
        self.routed = 0

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """The replica holding the request's longest known prefix first (if it is not much
        busier than the least loaded), then the less loaded of two random replicas."""
        if not candidate_replicas:
            return []
        if pending_request is not None:
            # Ray Serve sleeps between routing attempts only when asked to: without it, a request
            # waiting while every replica is full would probe them in a tight loop.
            pending_request.routing_context.should_backoff = True
        asked = _asked_for(pending_request)
        if asked is not None:
            for replica in candidate_replicas:
                if replica.replica_id.unique_id == asked:
                    return [[replica]]
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        loads = {replica.replica_id: self._load(replica) for replica in candidate_replicas}
        lightest = min(loads.values())
        prefix = _prefix_of(pending_request)
        if not prefix:
            return _two_choices(candidate_replicas, loads)
        for block in reversed(prefix):
            owner = self.owners.get(block)
            if owner is None or owner not in by_id:
                continue
            if loads[owner] <= lightest + self.max_imbalance:
                if self._attempt(pending_request) <= AFFINITY_ATTEMPTS:
                    return [[by_id[owner]]]
                others = [replica for replica in candidate_replicas if replica.replica_id != owner]
                return [[by_id[owner]], *_two_choices(others, loads)]
            break  # its replica is too busy: balance instead
        # A new prefix (or one whose replica is too busy): the emptiest cache among the not-too-busy.
        eligible = [r for r in candidate_replicas if loads[r.replica_id] <= lightest + self.max_imbalance]
        emptiest = min(eligible, key=lambda r: (self.owned[r.replica_id], loads[r.replica_id], random.random()))
        # Claimed now, not once routed: requests routed meanwhile (the same prefix, or other
        # new ones) must see it, or a burst of new prefixes would all pick one replica.
        self._claim(prefix, emptiest.replica_id)
        others = [replica for replica in candidate_replicas if replica is not emptiest]
        return [[emptiest], *_two_choices(others, loads)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """Remember that the request's blocks are now cached on ``replica_id``."""
        prefix = _prefix_of(pending_request)
        self.attempts.pop(pending_request.metadata.internal_request_id, None)
        self.routed += 1
        self._claim(prefix, replica_id)

    def _claim(self, prefix: tuple[int, ...], replica_id: ReplicaID) -> None:
        """Record ``prefix``'s blocks as cached on ``replica_id``."""
        for block in prefix:
            previous = self.owners.get(block)
            if previous != replica_id:
                if previous is not None and previous in self.owned:
                    self.owned[previous] -= 1
                self.owned[replica_id] += 1
            self.owners[block] = replica_id
            self.owners.move_to_end(block)
        while len(self.owners) > self.max_entries:
            _, owner = self.owners.popitem(last=False)
            if owner in self.owned:
                self.owned[owner] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """Forget a dead replica's share (its cache went with it). Its blocks stay in the table,
        never chosen (it is no candidate), until they are claimed again or forgotten as the
        least recently used: scanning the table here would hold the loop."""
        super().on_replica_actor_died(replica_id)
        self.owned.pop(replica_id, None)

    def _attempt(self, pending_request: PendingRequest | None) -> int:
        """Count one more routing attempt of ``pending_request``; the count."""
        if pending_request is None:
            return AFFINITY_ATTEMPTS + 1
        key = pending_request.metadata.internal_request_id
        count = self.attempts.get(key, 0) + 1
        self.attempts[key] = count
        while len(self.attempts) > self.max_entries:  # requests cancelled before they were routed
            self.attempts.popitem(last=False)
        return count

    def _load(self, replica: RunningReplica) -> int:
        queue_len = self.replica_queue_len_cache.get(replica.replica_id)
        return 0 if queue_len is None else int(queue_len)


def _prefix_of(pending_request: PendingRequest | None) -> tuple[int, ...]:
    if pending_request is None or not pending_request.args:
        return ()
    request = pending_request.args[0]
    return request.prefix if isinstance(request, ForwardedRequest) else ()


def _asked_for(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None or not pending_request.args:
        return None
    request = pending_request.args[0]
    return request.replica if isinstance(request, ForwardedRequest) else None


def _two_choices(replicas: list[RunningReplica], loads: Mapping[ReplicaID, int]) -> list[list[RunningReplica]]:
    """Two random replicas, the less loaded first, then the rest: power of two choices."""
    if len(replicas) <= 2:
        return [sorted(replicas, key=lambda r: (loads[r.replica_id], random.random()))] if replicas else []
    chosen = random.sample(replicas, 2)
    chosen.sort(key=lambda r: loads[r.replica_id])
    rest = [replica for replica in replicas if replica not in chosen]
    return [chosen, rest]
