"""AdminService's changes in a cluster: recorded once, applied by every server.

AddBackend, RemoveBackend, Pause, Resume and UpdateWeights on any server append an operation
to the store's `admin_ops` table (NOTIFY prorl_admin). Every server applies
the operations it has not applied yet, in order, to its own router, and
records the last one it applied (`servers.admin_applied`); a server that
starts applies them all, so it joins with the cluster's backends, pause state
and policy version. The call returns once every live server has applied it
(UNAVAILABLE naming those that have not within cluster.lease_ttl_s: the
change is recorded and they apply it when they can).

There is one policy version for the cluster (`cluster_state`): Resume picks
the next one in the store, under a row lock, so two Resumes on two servers
never give the same version.

Backends added at run time, API keys included, are kept in the store: the
database is as secret as the keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import structlog

from prorl_server.cluster.store import ADMIN_CHANNEL, UNREACHABLE, ClusterStore
from prorl_server.errors import AlreadyExists, FailedPrecondition, InvalidArgument, ProrlError, Unavailable
from prorl_server.llm.administration import WeightsUpdated, WeightUpdate, new_weights_version, tell_version
from prorl_server.llm.backend_settings import BackendSettings
from prorl_server.llm.factory import build_backend
from prorl_server.llm.router import BackendEntry, BackendRouter

log = structlog.get_logger(__name__)

ACK_POLL_S = 0.05


class ClusterAdministration:
    def __init__(
        self,
        store: ClusterStore,
        router: BackendRouter,
        *,
        request_timeout_s: float,
        max_retries: int,
        live_within_s: float,
    ) -> None:
        self._store = store
        self._router = router
        self._timeout_s = request_timeout_s
        self._max_retries = max_retries
        self._live_within_s = live_within_s
        self.applied = 0
        """The last operation applied here."""
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()

    # --- AdminService -----------------------------------------------------------------

    async def add_backend(self, settings: BackendSettings) -> BackendEntry:
        if any(entry.id == settings.id for entry in self._router.entries()):
            raise AlreadyExists(f"backend {settings.id!r} already exists; remove it first to replace it")
        build_backend(settings, timeout_s=self._timeout_s, max_retries=self._max_retries)  # refused here if bad
        data = settings.model_dump(mode="json")
        data["api_key"] = settings.api_key.get_secret_value()
        await self._record("add_backend", data)
        entry = next((entry for entry in self._router.entries() if entry.id == settings.id), None)
        if entry is None:
            raise Unavailable(f"backend {settings.id!r} was recorded but not added here; see the server's log")
        return entry

    async def remove_backend(self, backend_id: str) -> None:
        entry = next((entry for entry in self._router.entries() if entry.id == backend_id), None)
        if entry is None or entry.managed:
            await self._router.remove(backend_id)  # NotFound or FailedPrecondition, with its message
        await self._record("remove_backend", {"id": backend_id})

    async def pause(self, *, abort_in_flight: bool) -> tuple[int, int]:
        before = self._router.aborted_total
        await self._record("pause", {"abort_in_flight": abort_in_flight})
        return self._router.aborted_total - before, self._router.policy_version

    async def resume(self, policy_version: int | None) -> int:
        if policy_version is not None and policy_version < 0:
            raise InvalidArgument(f"policy_version must not be negative, got {policy_version}")
        # Weights loaded by UpdateWeights during this pause were staged on every server.
        staged = self._router.staged_version

        async def next_version(conn: Any) -> dict[str, Any]:
            current = await conn.fetchval("SELECT policy_version FROM cluster_state WHERE id = 1 FOR UPDATE")
            version = policy_version if policy_version is not None else staged if staged is not None else current + 1
            if version < max(current, staged or 0):
                raise FailedPrecondition(
                    f"policy version {version} is older than the cluster's current {current}; versions only grow"
                )
            await conn.execute("UPDATE cluster_state SET policy_version = $1 WHERE id = 1", version)
            return {"policy_version": version}

        await self._record("resume", next_version)
        return self._router.policy_version

    async def update_weights(self, request: WeightUpdate) -> WeightsUpdated:
        """This server loads the checkpoint into its backends (those added to the cluster
        included) and answers for them; then every other server loads it into its own.
        A server that cannot stays paused (`router.held`) rather than serve old weights
        under the new version."""
        targets = self._router.weight_targets(request.backend_ids)
        try:
            current = await self._store.pool.fetchval("SELECT policy_version FROM cluster_state WHERE id = 1")
        except UNREACHABLE as exc:
            raise _unreachable(exc) from None
        version = new_weights_version(request, max(current, self._router.policy_version))
        loaded = await self._router.load_weights(targets, request.model_path)
        await tell_version(targets, version)
        await self._record(
            "update_weights",
            {
                "model_path": request.model_path,
                "backend_ids": list(request.backend_ids),
                "policy_version": version,
                "origin": self._store.server_id,
            },
        )
        if request.resume:
            await self.resume(version)
        return WeightsUpdated(version, loaded, request.resume)

    async def _load_weights_here(self, data: dict[str, Any]) -> None:
        version = int(data["policy_version"])
        if data["origin"] != self._store.server_id:
            # Backends added to the whole cluster were loaded once, by the server that was asked;
            # each server loads its own (its embedded model, the backends of its settings).
            named = set(data["backend_ids"])
            targets = [
                e
                for e in self._router.entries()
                if not e.shared and e.backend.loads_weights and (not named or e.id in named)
            ]
            try:
                await self._router.load_weights(targets, data["model_path"])
                await tell_version(targets, version)
            except ProrlError as exc:
                self._router.held = f"new weights (version {version}) failed to load: {exc.message}"
                log.error("weights_not_loaded", policy_version=version, error=exc.message)
                return
        self._router.stage(version)

    # --- applying ---------------------------------------------------------------------

    def wake(self, _payload: str = "") -> None:
        self._wake.set()

    async def catch_up(self) -> int:
        """Apply every operation recorded after the last one applied here; returns how many."""
        async with self._lock:
            rows = await self._store.pool.fetch(
                "SELECT id, kind, payload FROM admin_ops WHERE id > $1 ORDER BY id", self.applied
            )
            # A server catching up loads only the latest checkpoint: older ones may be gone.
            latest_weights = max((row["id"] for row in rows if row["kind"] == "update_weights"), default=0)
            for row in rows:
                if row["kind"] != "update_weights" or row["id"] == latest_weights:
                    await self._apply(row["kind"], json.loads(row["payload"]))
                self.applied = row["id"]
            if rows:
                await self._store.pool.execute(
                    "UPDATE servers SET admin_applied = $2 WHERE server_id = $1", self._store.server_id, self.applied
                )
        return len(rows)

    async def run(self, poll_s: float) -> None:
        """Apply operations as they are recorded (notified, or polled every `poll_s`)."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(poll_s):
                    await self._wake.wait()
            self._wake.clear()
            try:
                await self.catch_up()
            except UNREACHABLE:
                continue  # applied when the store is back
            except Exception:  # a bug, or a database refusing: log it, keep the loop alive
                log.exception("admin_ops_not_applied")

    async def _apply(self, kind: str, data: dict[str, Any]) -> None:
        try:
            match kind:
                case "add_backend":
                    settings = BackendSettings.model_validate(data)
                    backend = build_backend(settings, timeout_s=self._timeout_s, max_retries=self._max_retries)
                    self._router.add(backend).shared = True
                case "remove_backend":
                    await self._router.remove(data["id"])
                case "pause":
                    self._router.pause(abort_in_flight=bool(data["abort_in_flight"]))
                case "resume":
                    self._router.resume(int(data["policy_version"]))
                case "update_weights":
                    await self._load_weights_here(data)
                case _:
                    log.error("admin_op_unknown", kind=kind)
        except ProrlError as exc:  # e.g. a backend id this server's own config already uses
            log.warning("admin_op_not_applied", kind=kind, error=exc.message)

    async def _record(self, kind: str, data: dict[str, Any] | Any) -> None:
        """Append an operation, apply it here, and wait until every live server has."""
        try:
            async with self._store.pool.acquire() as conn, conn.transaction():
                payload = await data(conn) if callable(data) else data
                op_id = await conn.fetchval(
                    "INSERT INTO admin_ops (time, kind, payload) VALUES ($1, $2, $3) RETURNING id",
                    time.time(),
                    kind,
                    json.dumps(payload).encode(),
                )
                await conn.execute("SELECT pg_notify($1, $2)", ADMIN_CHANNEL, str(op_id))
            await self.catch_up()
            await self._await_everyone(op_id)
        except UNREACHABLE as exc:
            raise _unreachable(exc) from None

    async def _await_everyone(self, op_id: int) -> None:
        deadline = time.monotonic() + self._live_within_s
        while True:
            behind = await self._store.pool.fetch(
                "SELECT server_id FROM servers WHERE admin_applied < $1 "
                "AND heartbeat > EXTRACT(EPOCH FROM clock_timestamp()) - $2 ORDER BY server_id",
                op_id,
                self._live_within_s,
            )
            if not behind:
                return
            if time.monotonic() > deadline:
                names = ", ".join(row["server_id"] for row in behind)
                raise Unavailable(
                    f"the change is recorded, but servers {names} have not applied it within "
                    f"{self._live_within_s:g} s; they apply it when they reach the store"
                )
            await asyncio.sleep(ACK_POLL_S)


def _unreachable(exc: BaseException) -> Unavailable:
    return Unavailable(
        f"the cluster's job store cannot be reached to record the change ({type(exc).__name__}); retry later"
    )
