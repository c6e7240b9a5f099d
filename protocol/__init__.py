"""meshfl.protocol"""
