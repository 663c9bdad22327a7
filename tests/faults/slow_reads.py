"""A prefill whose tcp listener serves the READs of chosen requests late: a decode's read of their
blocks stays in flight for `delay_s`, deterministically. Test-only: the workers build it through
`slow_read_role` (a RoleSpec factory, pickled by reference), so production code carries no hook."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from bootstrap.server import BootstrapServer
from disagg.api.app import create_app
from disagg.api.app import start_server as start_http
from disagg.api.state import STATE
from disagg.config import ServerConfig
from disagg.pd_config import DisaggConfig, with_settings
from disagg.registry_config import BootstrapConfig
from disagg.engine_config import EngineConfig
from disagg.worker.roles import RoleSpec
from disagg.launch import RunningServer
from kvtransfer.tcp.wire import FrameKind
from disagg.dp.prefill_front import PrefillController
from prefill.role import PrefillRole


class SlowReadPrefillRole(PrefillRole):
    """Before serving a READ whose tag holds `slow_tag`, touch `marker` (the read is in flight now),
    then wait `delay_s`."""

    def __init__(self, *args, slow_tag: bytes, marker: str, delay_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.slow_tag, self.marker, self.delay_s = slow_tag, Path(marker), delay_s

    async def start(self) -> None:
        await super().start()
        server = self.backend._server  # the tcp backend's listener (test-only reach into it)
        serve = server._serve_frame

        def serve_late(conn, peer, head):
            if head.kind is FrameKind.READ and self.slow_tag in head.tag:
                self.marker.touch()
                time.sleep(self.delay_s)
            serve(conn, peer, head)

        server._serve_frame = serve_late


def slow_read_role(core, dp_rank: int, model_name: str, **kwargs) -> SlowReadPrefillRole:
    return SlowReadPrefillRole(core, dp_rank, model_name, **kwargs)


async def start_slow_prefill(disagg: DisaggConfig, engine: EngineConfig, *, slow_tag: bytes, marker: Path,
                             delay_s: float, dp_size: int = 2) -> RunningServer:
    """What disagg.launch.start_server builds for a prefill, with SlowReadPrefillRole workers."""
    bootstrap = BootstrapServer(BootstrapConfig(host=disagg.prefill.bootstrap_host, port=0))
    disagg = with_settings(disagg, bootstrap_port=await bootstrap.start())
    server = ServerConfig(port=0, dp_size=dp_size, disaggregation_mode="prefill", load_balance_method="follow_bootstrap_room")
    role = RoleSpec(slow_read_role, dict(
        config=disagg, dp_size=dp_size, load_balance_method=server.load_balance_method,
        slow_tag=slow_tag, marker=str(marker), delay_s=delay_s))
    controller = PrefillController(server, engine, role, disagg)
    try:
        await controller.start()
        app = create_app(server, controller)
        runner, port = await start_http(app, server.host, server.port)
    except BaseException:
        await controller.close()
        await bootstrap.close()
        raise
    return RunningServer(controller, runner, port, app[STATE].drain, bootstrap)
