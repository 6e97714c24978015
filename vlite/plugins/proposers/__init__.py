"""vlite's built-in speculative-decoding proposers."""
