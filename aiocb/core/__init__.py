"""The pure-Python core: requests, block pool, KV block tables and the scheduler.

Nothing here imports torch or asyncio, so it is tested in microseconds.
"""
