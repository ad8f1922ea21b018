"""The ingress's modules reach `Ingress` through context.py's Protocols: none imports app.py,
not even under TYPE_CHECKING (issue 24: no import cycle, hidden or not)."""

from __future__ import annotations

import grimp

APP = "kvrelay.pipeline.server.app"


def test_no_server_module_imports_the_app():
    graph = grimp.build_graph("kvrelay", exclude_type_checking_imports=False)
    server = {m for m in graph.modules if m.startswith("kvrelay.pipeline.server.")}
    assert server - {APP}
    # app.py imports them all (create_app's route table), so any way back would be a cycle
    assert {m for m in server - {APP} if graph.find_shortest_chain(m, APP)} == set()
