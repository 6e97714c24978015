"""vlite's built-in tool-call parsers (``vlite serve --tool-call-parser NAME``)."""
