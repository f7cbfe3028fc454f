"""Offline bundles: create, verify and load everything a site needs across an air gap."""
