"""Test machinery kept out of the installed package: drafters, a reference speculative engine, EP faults."""
