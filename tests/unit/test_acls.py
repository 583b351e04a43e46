"""ACL bindings: the kafka-acls --list parser, the dict loader, and the authorizer against a
model of Kafka's StandardAuthorizer decision (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kcompact.replication.acls import (AclBinding, AclError, AclParseError, Authorizer,
                                       NoCapturedAclsError, bindings_from_dicts,
                                       load_captured_bindings, parse_acls_listing)

# as Kafka 3.9.1's kafka-acls --list prints it (tab-indented entries, a trailing space, a blank
# line after each resource)
LISTING = """\
Current ACLs for resource `ResourcePattern(resourceType=TOPIC, name=orders, patternType=LITERAL)`: 
 \t(principal=User:alice, host=*, operation=READ, permissionType=ALLOW)
\t(principal=User:CN=bob,OU=eng,O=Example\\, Inc.,C=US, host=10.0.0.1, operation=ALL, permissionType=DENY) 

Current ACLs for resource `ResourcePattern(resourceType=GROUP, name=team-, patternType=PREFIXED)`: 
 \t(principal=User:*, host=*, operation=READ, permissionType=ALLOW) 

"""


def test_listing_parses_every_field():
    got = parse_acls_listing(LISTING)
    assert got == [
        AclBinding("TOPIC", "orders", "LITERAL", "User:alice", "*", "READ", "ALLOW"),
        AclBinding("TOPIC", "orders", "LITERAL", "User:CN=bob,OU=eng,O=Example\\, Inc.,C=US",
                   "10.0.0.1", "ALL", "DENY"),
        AclBinding("GROUP", "team-", "PREFIXED", "User:*", "*", "READ", "ALLOW")]


def test_listing_error_names_the_line():
    bad = LISTING.replace("operation=READ, permissionType=ALLOW)\n\\t(",
                          "operation=READ, permissionType=ALLOW)\n\t(")
    text = bad.splitlines()
    text[4] = " \t(principal=User:x, host=*, operation=FLY, permissionType=ALLOW)"
    with pytest.raises(AclParseError, match=r"acls.txt line 5: .*operation 'FLY'"):
        parse_acls_listing("\n".join(text), "acls.txt")
    with pytest.raises(AclParseError, match="line 2: not a line kafka-acls --list prints"):
        parse_acls_listing("# my cluster\nhello\n", "f")
    with pytest.raises(AclParseError, match="line 1: an ACL entry before"):
        parse_acls_listing("(principal=User:a, host=*, operation=READ, permissionType=ALLOW)")


def test_dicts_roundtrip_and_bad_keys():
    bs = parse_acls_listing(LISTING)
    assert bindings_from_dicts([b.as_dict() for b in bs]) == bs
    with pytest.raises(AclError, match="binding 0: expected the keys"):
        bindings_from_dicts([{"resource_type": "TOPIC"}])
    row = bs[0].as_dict() | {"permission_type": "allow"}
    with pytest.raises(AclError, match="binding 0: ACL permission_type 'allow'"):
        bindings_from_dicts([row])


def test_no_capture_says_what_to_do(tmp_path):
    from kcompact.reput import Store

    url = str(tmp_path / "store")
    Store.open(url, writer="w", create=True).close()
    with pytest.raises(NoCapturedAclsError, match="run kcompact mirror"):
        load_captured_bindings(url)


def test_the_bindings_a_mirror_captured_are_the_endpoints(tmp_path):
    """--acls-from-store: what the mirror's capture kept (replication.acl_capture) is what the
    authorizer decides on, tombstoned bindings left out."""
    from kcompact.replication.acl_capture import AclCaptureWriter, binding_tuple

    url = str(tmp_path / "store")
    bs = parse_acls_listing(LISTING)
    w = AclCaptureWriter(url, "acl-writer")
    try:
        w.capture([binding_tuple(b.as_dict()) for b in bs], topics=["orders"], groups=["team-a"])
        assert sorted(load_captured_bindings(url), key=str) == sorted(bs, key=str)
        w.capture([binding_tuple(b.as_dict()) for b in bs[1:]], topics=["orders"], groups=["team-a"])
    finally:
        w.close()
    assert sorted(load_captured_bindings(url), key=str) == sorted(bs[1:], key=str)


def test_kafka_rules_by_example():
    a = Authorizer(parse_acls_listing(LISTING))
    assert a.authorize("User:alice", "1.2.3.4", "READ", "TOPIC", "orders")
    assert a.authorize("User:alice", "1.2.3.4", "DESCRIBE", "TOPIC", "orders")  # implied
    assert not a.authorize("User:alice", "1.2.3.4", "WRITE", "TOPIC", "orders")
    assert not a.authorize("User:alice", "1.2.3.4", "READ", "TOPIC", "orders2")  # literal
    assert a.authorize("User:zed", "h", "READ", "GROUP", "team-a")  # prefixed, User:*
    assert not a.authorize("User:zed", "h", "READ", "GROUP", "team")
    assert not a.authorize("User:zed", "h", "READ", "TOPIC", "nobody")  # no ACL: denied
    assert Authorizer([], allow_everyone_if_no_acl_found=True).authorize(
        "User:zed", "h", "READ", "TOPIC", "nobody")
    # deny beats allow
    both = [AclBinding("TOPIC", "*", "LITERAL", "User:*", "*", "ALL", "ALLOW"),
            AclBinding("TOPIC", "pay", "PREFIXED", "User:eve", "*", "READ", "DENY")]
    a = Authorizer(both)
    assert a.authorize("User:bob", "h", "READ", "TOPIC", "payments")
    assert not a.authorize("User:eve", "h", "READ", "TOPIC", "payments")
    assert a.authorize("User:eve", "h", "DESCRIBE", "TOPIC", "payments")  # deny READ only


# -- the model ----------------------------------------------------------------------------

NAMES = st.sampled_from(["a", "ab", "abc", "b", "ba", "*"])
PRINCIPALS = st.sampled_from(["User:alice", "User:bob", "User:*"])
HOSTS = st.sampled_from(["1.1.1.1", "2.2.2.2", "*"])
OPS = st.sampled_from(["ALL", "READ", "WRITE", "DESCRIBE", "DELETE", "ALTER", "CREATE",
                       "ALTER_CONFIGS", "DESCRIBE_CONFIGS"])
BINDINGS = st.builds(AclBinding, st.sampled_from(["TOPIC", "GROUP"]), NAMES,
                     st.sampled_from(["LITERAL", "PREFIXED"]), PRINCIPALS, HOSTS, OPS,
                     st.sampled_from(["ALLOW", "DENY"]))


def model(bindings, principal, host, op, rtype, name, everyone):
    """Kafka's rules, written as sets: the bindings on the resource, those for the request."""
    def on_resource(b):
        if b.resource_type != rtype:
            return False
        if b.pattern_type == "PREFIXED":
            return name[:len(b.resource_name)] == b.resource_name
        return b.resource_name in {name, "*"}

    res = [b for b in bindings if on_resource(b)]
    mine = [b for b in res if b.principal in {principal, "User:*"} and b.host in {host, "*"}]
    denying = {b for b in mine if b.permission_type == "DENY" and b.operation in {op, "ALL"}}
    implied = {"DESCRIBE": {"READ", "WRITE", "DELETE", "ALTER"},
               "DESCRIBE_CONFIGS": {"ALTER_CONFIGS"}}.get(op, set())
    allowing = {b for b in mine if b.permission_type == "ALLOW"
                and b.operation in {op, "ALL"} | implied}
    if denying:
        return False
    if allowing:
        return True
    return everyone and not res


@settings(max_examples=400, deadline=None)
@given(st.lists(BINDINGS, max_size=8), st.sampled_from(["User:alice", "User:bob"]),
       st.sampled_from(["1.1.1.1", "2.2.2.2"]),
       st.sampled_from(["READ", "WRITE", "DESCRIBE", "DELETE", "ALTER", "DESCRIBE_CONFIGS"]),
       st.sampled_from(["TOPIC", "GROUP"]), st.sampled_from(["a", "ab", "abc", "b", "x"]),
       st.booleans())
def test_authorizer_matches_the_model(bindings, principal, host, op, rtype, name, everyone):
    a = Authorizer(bindings, allow_everyone_if_no_acl_found=everyone)
    assert a.authorize(principal, host, op, rtype, name) == \
        model(bindings, principal, host, op, rtype, name, everyone)


@settings(max_examples=100, deadline=None)
@given(st.lists(BINDINGS, max_size=6))
def test_listing_roundtrip(bindings):
    """A listing written the way kafka-acls prints it parses back to the same bindings."""
    text = ""
    for b in bindings:
        text += (f"Current ACLs for resource `ResourcePattern(resourceType={b.resource_type}, "
                 f"name={b.resource_name}, patternType={b.pattern_type})`: \n \t(principal="
                 f"{b.principal}, host={b.host}, operation={b.operation}, permissionType="
                 f"{b.permission_type}) \n\n")
    assert parse_acls_listing(text) == bindings
