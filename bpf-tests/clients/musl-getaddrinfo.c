/*
 * One getaddrinfo(3) lookup of NAME, linked statically against musl (musl-gcc -static), so that
 * musl's resolver, not glibc's, asks the nameservers of /etc/resolv.conf. musl sends every query
 * of a lookup (A and AAAA) from one unconnected UDP socket of its own, to every nameserver at
 * once, and sends again every timeout/attempts until the timeout.
 *
 * Prints the first address (IPv4 first) and exits 0, or prints "error: " and gai_strerror's text
 * and exits 1.
 */
#include <arpa/inet.h>
#include <netdb.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

int main(int argc, char **argv)
{
	struct addrinfo hints, *found, *entry, *chosen = NULL;
	char text[INET6_ADDRSTRLEN];
	int rc;

	if (argc != 2) {
		fprintf(stderr, "usage: %s NAME\n", argv[0]);
		return 2;
	}
	memset(&hints, 0, sizeof(hints));
	hints.ai_family = AF_UNSPEC;
	hints.ai_socktype = SOCK_DGRAM;
	rc = getaddrinfo(argv[1], NULL, &hints, &found);
	if (rc != 0) {
		printf("error: %s\n", gai_strerror(rc));
		return 1;
	}
	for (entry = found; entry != NULL; entry = entry->ai_next) {
		if (entry->ai_family == AF_INET) {
			chosen = entry;
			break;
		}
	}
	if (chosen == NULL)
		chosen = found;
	if (chosen->ai_family == AF_INET)
		inet_ntop(AF_INET, &((struct sockaddr_in *)chosen->ai_addr)->sin_addr, text,
			  sizeof(text));
	else
		inet_ntop(AF_INET6, &((struct sockaddr_in6 *)chosen->ai_addr)->sin6_addr, text,
			  sizeof(text));
	printf("%s\n", text);
	freeaddrinfo(found);
	return 0;
}
