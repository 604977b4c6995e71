"""The aggregator's side of a refused TLS connection: gRPC's handshake failure lines (samples of
grpc 1.65's own output) become one sentence naming the peer and the cause; everything else written to
standard error passes through unchanged and in order, even at exit."""

import logging
import subprocess
import sys
import textwrap

import pytest

from fedcontrast.openfl.tls_log import HandshakeLog, enable_handshake_trace, split_peer

PEER_LINE = ("I0000 00:00:1795415118.282748   {thread} handshaker.cc:95] handshake_manager {manager}: error=OK "
             "shutdown=0 index=1, args={{endpoint=0x7f6384000f50, args={{grpc.internal.endpoint_local_address="
             "ipv4:127.0.0.1:50555, grpc.internal.endpoint_peer_address={peer}, grpc.internal.security_connector="
             "0x558577c15890}}}}")
FATAL_LINE = ("E0000 00:00:1795415118.285203   {thread} ssl_transport_security.cc:1650] Handshake failed with fatal "
              "error SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:{code}.")
DONE_LINE = ("I0000 00:00:1795415118.285398   {thread} handshaker.cc:124] handshake_manager {manager}: handshaking "
             "complete -- scheduling on_handshake_done with error=UNKNOWN:{error}")
CLOSED = ('Handshake read failed {created_time:"2026-11-23T06:26:18.577181872+00:00", children:[INTERNAL:Socket '
          'closed {fd:6, grpc_status:14}]}')


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def refusal(log, *, peer="ipv4:10.200.0.4:51234", code="CERTIFICATE_VERIFY_FAILED", thread="30770",
            manager="0x7f63840019e0"):
    """Feed one refused handshake; what was shown as is."""
    lines = [PEER_LINE.format(thread=thread, manager=manager, peer=peer), FATAL_LINE.format(thread=thread, code=code),
             DONE_LINE.format(thread=thread, manager=manager, error=f"Ssl handshake failed (TSI_PROTOCOL_FAILURE): "
                              f"SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:{code}")]
    return [line for line in lines if log.feed(line)]


@pytest.mark.parametrize("code, words", [
    ("CERTIFICATE_VERIFY_FAILED", "does not verify against the federation's CA in cert/cert_chain.crt (it is signed "
                                  "by another CA, or it is expired or not yet valid)"),
    ("PEER_DID_NOT_RETURN_A_CERTIFICATE", "it presented no certificate"),
    ("WRONG_VERSION_NUMBER", "it does not speak TLS"),
    ("BLOCK_TYPE_IS_NOT_01", "names the federation's CA (cert/cert_chain.crt) as its issuer, but that CA's signature "
                             "does not verify: another CA of the same name signed it"),
    ("SOMETHING_NEW", "the TLS library reports SOMETHING_NEW"),
])
def test_each_refusal_is_one_sentence_naming_the_peer_and_the_cause(code, words):
    log = HandshakeLog(chain="cert/cert_chain.crt")
    assert refusal(log, code=code) == []  # gRPC's own lines are replaced, not shown as well
    [(level, text, host)] = log.messages
    assert level == logging.WARNING and log.refused == 1 and host == "10.200.0.4"
    assert text.startswith("refused a TLS connection from 10.200.0.4 (port 51234): ")
    assert words in text and "nothing from it was accepted" in text and "fedcontrast doctor" in text


# Captured from grpc 1.65's aggregator for client certificates naming the federation's signing CA as issuer
# but signed by another CA of that name: which error comes first depends on the two keys, not on the mistake.
@pytest.mark.parametrize("error", [
    "error:0400006b:RSA routines:OPENSSL_internal:BLOCK_TYPE_IS_NOT_01",
    "error:04000073:RSA routines:OPENSSL_internal:DATA_TOO_LARGE_FOR_MODULUS",  # signature ≥ the CA key's modulus
    "error:04000070:RSA routines:OPENSSL_internal:DATA_LEN_NOT_EQUAL_TO_MOD_LEN",  # a 4096-bit CA key, ours 3072
    "error:0c0000bd:ASN.1 encoding routines:OPENSSL_internal:WRONG_PUBLIC_KEY_TYPE",  # an EC CA key, ours RSA
    "error:040000ff:RSA routines:OPENSSL_internal:A_REASON_NOT_SEEN_YET",  # any RSA failure: a signature check
])
def test_every_way_another_ca_of_the_same_name_fails_is_named_alike(error):
    log = HandshakeLog(chain="cert/cert_chain.crt")
    line = ("E0000 00:00:1795710236.495675    5474 ssl_transport_security.cc:1650] Handshake failed with fatal "
            f"error SSL_ERROR_SSL: {error}.")
    assert log.feed(PEER_LINE.format(thread="5474", manager="0xa", peer="ipv6:%5B::1%5D:46108")) is False
    assert log.feed(line) is False
    [(level, text, host)] = log.messages
    assert level == logging.WARNING and host == "::1"
    assert ("the certificate it presented names the federation's CA (cert/cert_chain.crt) as its issuer, but that "
            "CA's signature does not verify: another CA of the same name signed it") in text
    assert "the TLS library reports" not in text


def test_different_reports_of_one_forged_certificate_count_as_one_cause():
    log = HandshakeLog()
    refusal(log, code="BLOCK_TYPE_IS_NOT_01")
    refusal(log, code="DATA_TOO_LARGE_FOR_MODULUS")
    assert log.refused == 2 and len(log.messages) == 1


def test_the_peer_is_the_one_of_the_thread_that_failed():
    log = HandshakeLog()
    log.feed(PEER_LINE.format(thread="1", manager="0xa", peer="ipv4:10.0.0.1:1111"))
    log.feed(PEER_LINE.format(thread="2", manager="0xb", peer="ipv4:10.0.0.2:2222"))
    log.feed(FATAL_LINE.format(thread="1", code="CERTIFICATE_VERIFY_FAILED"))
    log.feed(FATAL_LINE.format(thread="3", code="CERTIFICATE_VERIFY_FAILED"))  # no peer line seen for thread 3
    assert "from 10.0.0.1 (port 1111)" in log.messages[0][1]
    assert "(peer address unknown)" in log.messages[1][1]


def test_a_peer_that_closes_during_the_handshake_and_a_wrong_server_name():
    log = HandshakeLog()
    log.feed(PEER_LINE.format(thread="7", manager="0xc", peer="ipv6:%5B::1%5D:47632"))
    assert not log.feed(DONE_LINE.format(thread="7", manager="0xc", error=CLOSED))
    assert not log.feed("E0000 00:00:1795415181.728946   7 ssl_transport_security.cc:2113] No match found for server "
                        "name: other.host")
    (closed_level, closed, _), (_, name, _) = log.messages
    assert closed_level == logging.INFO
    assert closed.startswith("refused a TLS connection from ::1 (port 47632): it closed")
    assert ("it asked for the aggregator by the name other.host, which this aggregator's certificate does not name"
            in name)


def test_repeats_are_counted_not_repeated():
    clock = Clock()
    log = HandshakeLog(clock=clock, repeat_s=60)
    for port in range(10):
        refusal(log, peer=f"ipv4:10.200.0.4:{5000 + port}")
        clock.now += 1
    assert len(log.messages) == 1 and log.refused == 10
    refusal(log, peer="ipv4:10.200.0.9:5000")  # another host is reported at once
    assert len(log.messages) == 2
    clock.now += 60
    refusal(log, peer="ipv4:10.200.0.4:6000")
    assert len(log.messages) == 3 and log.messages[-1][1].endswith("[10 more since the last report]")


def test_certificates_signed_here_that_sites_cannot_use_are_added():
    log = HandshakeLog(enrolled_problems=["hosp3's certificate cert/client/col_hosp3.crt (CN=hosp3) expired on "
                                          "2026-11-20 10:00 UTC"])
    refusal(log)
    assert log.messages[0][1].endswith("Certificates signed here that sites cannot use: hosp3's certificate "
                                       "cert/client/col_hosp3.crt (CN=hosp3) expired on 2026-11-20 10:00 UTC")


def test_other_lines_pass_and_the_trace_we_turned_on_is_hidden():
    log = HandshakeLog(quiet_info=True)
    assert log.feed("Traceback (most recent call last):")
    assert log.feed("W0000 00:00:1795415118.0   5 chttp2_transport.cc:1] keepalive watchdog timeout")
    assert log.feed("E0000 00:00:1795415118.0   5 server.cc:1] something else went wrong")
    assert not log.feed("I0000 00:00:1795415118.0   5 handshaker.cc:70] handshake_manager 0x1: adding handshaker")
    assert not log.feed("W0000 00:00:1795415032.977831   30578 log.cc:135] Log level INFO is not suitable for "
                        "production. Prefer WARNING or ERROR.")
    assert HandshakeLog(quiet_info=False).feed("I0000 00:00:1795415118.0   5 handshaker.cc:70] the operator's trace")
    assert log.messages == []


def test_split_peer():
    assert split_peer("ipv4:10.0.0.3:5123") == ("10.0.0.3", "5123")
    assert split_peer("ipv6:%5B::1%5D:5123") == ("::1", "5123")
    assert split_peer(None) == (None, None)


def test_the_operators_own_grpc_logging_is_respected():
    env = {"GRPC_VERBOSITY": "ERROR"}
    assert enable_handshake_trace(env) is False and "GRPC_TRACE" not in env
    env = {}
    assert enable_handshake_trace(env) is True and env == {"GRPC_VERBOSITY": "INFO", "GRPC_TRACE": "handshaker"}


TAP_SCRIPT = textwrap.dedent("""
    import logging, os, sys
    from fedcontrast.openfl.tls_log import HandshakeLog, StderrTap
    logging.basicConfig(stream=sys.stdout, format="LOG %(levelname)s %(message)s", level=logging.INFO)
    StderrTap(HandshakeLog()).start()
    print("python line 1", file=sys.stderr, flush=True)
    os.write(2, (PEER + "\\n").encode())
    os.write(2, b"c-level line 2\\n")
    os.write(2, (FATAL + "\\n").encode())
    os.write(2, b"partial ")
    os.write(2, b"line 3\\n" + b"x" * 200000 + b"\\n")
    raise RuntimeError("the last words")
""")


def test_the_tap_loses_nothing_and_keeps_the_order(tmp_path):
    """In a separate process (the tap takes over file descriptor 2): ordinary lines in order, a large
    write, the traceback of an exception at exit, and the sentence instead of gRPC's lines."""
    script = (f"PEER = {PEER_LINE.format(thread='9', manager='0x9', peer='ipv4:10.200.0.4:51234')!r}\n"
              f"FATAL = {FATAL_LINE.format(thread='9', code='CERTIFICATE_VERIFY_FAILED')!r}\n" + TAP_SCRIPT)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    err = done.stderr.splitlines()
    assert err[:3] == ["python line 1", "c-level line 2", "partial line 3"]
    assert err[3] == "x" * 200000
    assert err[-1] == "RuntimeError: the last words" and "Traceback (most recent call last):" in err
    assert "Handshake failed" not in done.stderr and "handshake_manager" not in done.stderr
    assert ("LOG WARNING refused a TLS connection from 10.200.0.4 (port 51234): the certificate it presented does "
            "not verify against the federation's CA") in done.stdout


def test_a_closed_terminal_does_not_stop_the_aggregator():
    """The real standard error goes away (the operator's terminal closed): the tap keeps draining, so
    writers never block on a full pipe."""
    script = textwrap.dedent("""
        import os, sys
        from fedcontrast.openfl.tls_log import HandshakeLog, StderrTap
        StderrTap(HandshakeLog()).start()
        for _ in range(40):
            os.write(2, b"y" * 10000 + b"\\n")
        print("still running", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stderr.close()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out == "still running\n"
