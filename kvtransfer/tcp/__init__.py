"""The tcp backend: length-prefixed frames over plain sockets and threads, no dependency beyond the
standard library.

backend.py (TcpBackend: one outgoing connection per peer, a sender and a receiver thread), server.py
(the listener: lands WRITEs in our region, answers READs), auth.py (the connection handshake and the
cluster secret's challenge), wire.py (the frame format).
"""
