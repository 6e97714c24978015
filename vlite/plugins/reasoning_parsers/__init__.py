"""vlite's built-in reasoning parsers (``vlite serve --reasoning-parser NAME``)."""
