"""The devices behind the Device protocol: scripted (recording, simulated), torch, and their helpers."""
