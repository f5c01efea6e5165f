"""The runtime: walks a Schedule on a backend. Decides nothing the Schedule does not say."""
