"""The live cluster dashboard of the proxy and the metaserver (`/dashboard`)."""
