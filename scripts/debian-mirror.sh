# scripts/debian-mirror.sh: sourced by scripts/install-deps.sh and images/build.sh (not run on its own).
#
# debian_mirror prints the Debian mirror this machine's apt already uses, so that a user's own mirror or caching
# proxy keeps serving everything hearth downloads and no mirror host is written into the repository:
#   1. HEARTH_MIRROR, when set (e.g. HEARTH_MIRROR=http://apt-cache.lan:3142/debian);
#   2. the URI of the first enabled `deb` entry of /etc/apt/sources.list.d/*.sources (deb822) or
#      /etc/apt/sources.list and /etc/apt/sources.list.d/*.list (one-line) whose suite is a Debian release
#      (not -security, -updates or -backports), the host's own release preferred.
# It fails with a message naming HEARTH_MIRROR when neither gives one.
#
# debian_keyring prints the Signed-By keyring of that entry (deb822 only), or Debian's archive keyring.

# Prints "URI SUITE SIGNED-BY" for every enabled deb entry of the apt sources ("-" for a missing keyring).
_hearth_apt_entries() {
    local f
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        awk '
            function flush() {
                if (types ~ /(^| )deb( |$)/ && enabled != "no" && uris != "") {
                    n = split(uris, u, " "); m = split(suites, s, " ")
                    for (i = 1; i <= n; i++) for (j = 1; j <= m; j++) print u[i], s[j], (key == "" ? "-" : key)
                }
                types = ""; uris = ""; suites = ""; key = ""; enabled = ""
            }
            /^[ \t]*#/ { next }
            /^[ \t]*$/ { flush(); next }
            {
                field = tolower($1); sub(/:$/, "", field)
                value = $0; sub(/^[^:]*:[ \t]*/, "", value)
                if (field == "types") types = value
                else if (field == "uris") uris = value
                else if (field == "suites") suites = value
                else if (field == "signed-by") key = value
                else if (field == "enabled") enabled = tolower(value)
            }
            END { flush() }
        ' "$f"
    done
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -f "$f" ] || continue
        # deb [options] URI SUITE COMPONENTS...
        sed -e 's/#.*//' -e 's/\[[^]]*\]//' "$f" | awk '$1 == "deb" && NF >= 3 { print $2, $3, "-" }'
    done
}

# The Debian release entries: suites without a -security, -updates or -backports suffix.
_hearth_release_entries() {
    _hearth_apt_entries | awk '$2 !~ /-(security|updates|backports|proposed-updates)$/ && $2 !~ /\//'
}

_hearth_host_codename() {
    (. /etc/os-release 2>/dev/null && printf '%s\n' "${VERSION_CODENAME:-}")
}

debian_mirror() {
    if [ -n "${HEARTH_MIRROR:-}" ]; then
        printf '%s\n' "${HEARTH_MIRROR%/}"
        return 0
    fi
    local codename entries uri
    codename=$(_hearth_host_codename)
    entries=$(_hearth_release_entries)
    uri=$(printf '%s\n' "$entries" | awk -v c="$codename" 'c != "" && $2 == c { print $1; exit }')
    [ -n "$uri" ] || uri=$(printf '%s\n' "$entries" | awk 'NF { print $1; exit }')
    if [ -z "$uri" ]; then
        echo "no Debian release found in the apt sources (/etc/apt/sources.list, /etc/apt/sources.list.d/):" \
            "set HEARTH_MIRROR to a Debian mirror URL" >&2
        return 1
    fi
    printf '%s\n' "${uri%/}"
}

debian_keyring() {
    local mirror key
    mirror=$(debian_mirror) || return 1
    key=$(_hearth_release_entries | awk -v m="$mirror" '{ u = $1; sub(/\/$/, "", u) } u == m && $3 != "-" { print $3; exit }')
    printf '%s\n' "${key:-/usr/share/keyrings/debian-archive-keyring.gpg}"
}
