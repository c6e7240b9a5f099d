"""meshfl.launch"""
