"""Redis connections with tokenrelay's settings and outage handling, and the embedded Redis."""
