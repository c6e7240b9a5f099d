"""meshfl.node"""
