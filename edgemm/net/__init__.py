"""What edgemm sends over the network and to whom: host allow-lists, outbound HTTP."""
