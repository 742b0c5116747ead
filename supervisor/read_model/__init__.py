"""The read model: `view.View`, built by the loop once per pass from its state, and its three renderings — the
`status` reply, `state.json` and the fields the metrics snapshot takes.  Readers (the control socket, the ops side)
get a view; none of them reads the loop.

May import: `processes`, `records`, `rules`, `watch` and `hangwatch.common`.
"""

MAY_IMPORT = ("processes", "records", "rules", "watch")
