"""The HTTP layer both servers share: app factory, msgpack bodies, error mapping.

Only the servers import this package (it needs FastAPI); ``shared/`` stays free of web frameworks
so that the device agent's minimal install and the logic objects never depend on one.
"""
