"""The engine worker process: one EngineCore behind the front's messages, and its role (unified, prefill, decode).

Every module here runs in a DP worker process (docs/architecture.md, "runs in"); the front imports
only what starts one (`process.WorkerSpec`, `roles.RoleSpec`), and neither imports torch until the worker does.
"""
