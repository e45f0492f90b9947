"""Serving (websocket protocol, WebRTC, browser demo) arrives with the serving issue; nothing here yet."""
